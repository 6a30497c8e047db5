"""Programs, and the pieces of them that tests/, bench/ and launch/ share.

Importable as `scripts.<name>` with the repo root on sys.path (pytest's `pythonpath = .`,
bench/common.py); a program runs as `python scripts/<name>.py`.

    make_model.py         `make model`: SmolLM2-135M-Instruct as a Hugging Face folder
    parity_check.py       the fp32 parity tolerance of the suite and the core packed-vs-padded
                          check, run per CPU kernel set by tests/test_portable_parity.py
    dist_train_worker.py  the FSDP2 gradient-parity rank body (tests/test_fsdp.py on gloo)
    distributed.py        `run_distributed`: a function on N gloo ranks over 127.0.0.1
    records.py            `make_records`: seeded per-sample records for the tiny models
    vllm_replay_gap.py    MoE routing replay from vLLM: the rollout/training log-prob gap, replay on vs off
"""
