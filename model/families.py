"""The supported model families, by Hugging Face `model_type`: the one list the config's
`model.name` choice (rl/config/schema.py), the model registry (model/models.py) and the tests read.
Imports nothing, so the config schema can name them without loading transformers."""

DENSE = ("llama", "mistral", "phi3", "qwen2", "qwen3")  # one forward path (model/actor.py)
MOE = ("qwen3_moe",)  # expert parallel (model/moe.py)
FAMILIES = DENSE + MOE
