"""Text tasks' chat: prompts rendered with the tokenizer's chat template, environment answers
as the tokens between two model turns, replies decoded, tokenizers loaded from local folders."""

from __future__ import annotations

import os
import weakref
from typing import Any, Callable


def without_thinking(tokenizer: Any, ids: list[int]) -> list[int]:
    """A past reply without its reasoning, as a Qwen3-style template renders an earlier assistant
    turn (`content.split('</think>')[-1].lstrip('\\n')`): every token up to the last `</think>`
    and the newlines after it dropped; a reply without `</think>` unchanged."""
    close = thinking_ids(tokenizer)[1]
    if close not in ids:
        return ids
    rest = ids[len(ids) - ids[::-1].index(close):]
    while rest and set(tokenizer.decode([rest[0]])) <= {"\n"} and tokenizer.decode([rest[0]]):
        rest = rest[1:]
    return rest


def thinking_ids(tokenizer: Any) -> tuple[int, int]:
    """The ids of `<think>` and `</think>`: single tokens of the tokenizer (Qwen3's are), else an error
    naming task.options.strip_thinking."""
    ids = []
    for token in ("<think>", "</think>"):
        found = tokenizer.convert_tokens_to_ids(token)
        if found is None or found == tokenizer.unk_token_id or tokenizer.decode([found]) != token:
            raise ValueError(f"task.options.strip_thinking=true but '{token}' is not one token of the tokenizer "
                             f"(a template with <think> blocks, such as Qwen3's, has it): nothing to strip")
        ids.append(found)
    return ids[0], ids[1]


def chat_encoder(tokenizer: Any, chat_template: str | None, system_prompt: str | None,
                  tokenizer_path: Any, enable_thinking: bool | None = None) -> Callable[[list[dict]], list[int]]:
    """messages -> prompt ids: the messages (after `system_prompt`) in the tokenizer's chat
    template ("tokenizer") or a Jinja template, with the generation prompt; or, with
    `chat_template=None`, the messages' texts as is (one message: its text). `enable_thinking`
    (`task.options.enable_thinking`; None: not passed) reaches the template as the variable of
    that name: Qwen3's template opens an empty `<think></think>` block when it is false; a
    template that does not read it renders the same."""
    if chat_template == "tokenizer" and not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"task.options.chat_template='tokenizer' but the tokenizer at '{tokenizer_path}' "
                         f"has no chat template; give a Jinja template instead (plain text: "
                         f"task.options.chat_template=\"{{{{ messages[-1]['content'] }}}}\")")
    if chat_template is None and system_prompt is not None:
        raise ValueError("task.options.system_prompt needs task.options.chat_template (a system message only "
                         "exists in a chat)")

    def encode(messages: list[dict]) -> list[int]:
        if chat_template is None:
            return list(tokenizer.encode("\n".join(m["content"] for m in messages)))
        system = [{"role": "system", "content": system_prompt}] if system_prompt is not None else []
        rendered = tokenizer.apply_chat_template(
            system + list(messages), tokenize=False, add_generation_prompt=True,
            chat_template=None if chat_template == "tokenizer" else chat_template, **_thinking(enable_thinking),
        )
        return list(tokenizer.encode(rendered, add_special_tokens=False))

    return encode


def user_turn(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


_SENTINEL = "\x00reply\x00"


def _thinking(enable_thinking: bool | None) -> dict:
    return {} if enable_thinking is None else {"enable_thinking": bool(enable_thinking)}


def observation_encoder(tokenizer: Any, chat_template: str | None,
                         enable_thinking: bool | None = None) -> Callable[[str], list[int]]:
    """text -> the ids of a user turn that answers an assistant turn, up to the next
    generation prompt: what the chat template puts after an assistant message's content
    (its end-of-turn, the user message, the assistant header), found by rendering a
    conversation whose assistant content is a sentinel. With `chat_template=None`: the
    text on its own line. The text's own characters never become special tokens
    (`encode_answers`)."""
    if chat_template is None:
        return lambda text: list(tokenizer.encode(f"\n{text}\n", add_special_tokens=False, split_special_tokens=True))
    template = None if chat_template == "tokenizer" else chat_template

    def render(texts: list[str]) -> str:
        rendered = tokenizer.apply_chat_template(
            user_turn("?") + [{"role": "assistant", "content": _SENTINEL}] + user_turn(texts[0]), tokenize=False,
            add_generation_prompt=True, chat_template=template, **_thinking(enable_thinking))
        if _SENTINEL not in rendered:
            raise ValueError("the chat template drops earlier assistant turns: a multi-turn episode cannot be "
                             "rendered token-in/token-out with it")
        return rendered[rendered.index(_SENTINEL) + len(_SENTINEL):]

    return lambda text: encode_answers(tokenizer, render, [text])


def special_texts(tokenizer: Any) -> tuple[str, ...]:
    """The texts of the tokenizer's special tokens (its added tokens marked special: `<|im_start|>`,
    `<|im_end|>`, ...), which a plain `encode` turns into their ids wherever they appear."""
    found = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return tuple(sorted({t.content for t in found.values() if getattr(t, "special", False) and t.content}
                        | set(getattr(tokenizer, "all_special_tokens", ()))))


def encode_answers(tokenizer: Any, render: Callable[[list[str]], str], texts: list[str]) -> list[int]:
    """`render(texts)` (a chat template's frame around answers: an environment's, the tools') as
    ids, the answers' own characters never turned into special tokens: a tool output holding
    `<|im_start|>user` is those characters' ordinary tokens, not a forged turn. Answers free of
    special-token text: the rendering encoded whole (as it always was). Otherwise the frame's
    pieces (found by rendering sentinels in the answers' places) are encoded as they are and the
    answers with `split_special_tokens=True`; a template that renders an answer other than as is
    (or stripped) is a ValueError."""
    rendered = render(texts)
    specials = special_texts(tokenizer)
    if not any(s in t for t in texts for s in specials):
        return list(tokenizer.encode(rendered, add_special_tokens=False))
    marks = [f"\x00answer{k}\x00" for k in range(len(texts))]
    frame = render(marks)
    pieces, rest = [], frame
    for mark in marks:
        head, found, rest = rest.partition(mark)
        if not found:
            raise ValueError("the chat template does not render an answer as its text: its special-token text "
                             "cannot be kept from becoming special tokens")
        pieces.append(head)
    pieces.append(rest)
    for shown in (texts, [t.strip() for t in texts]):  # as is, or stripped by the template
        if "".join(p + t for p, t in zip(pieces, shown)) + pieces[-1] == rendered:
            ids = []
            for piece, text in zip(pieces, shown):
                ids += tokenizer.encode(piece, add_special_tokens=False)
                ids += tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)
            return ids + list(tokenizer.encode(pieces[-1], add_special_tokens=False))
    raise ValueError("the chat template renders an answer holding special-token text other than as is (or stripped): "
                     "its special-token text cannot be kept from becoming special tokens")


def answer_chars(tokenizer: Any, max_tokens: int) -> int:
    """How many characters of an answer can matter when it is cut to `max_tokens` tokens: the
    answer's text is cut to this many before it is tokenized (a 10 MB answer costs what its
    first characters do). One token stands for at most as many characters as its longest
    vocabulary entry has (a byte-level entry has one character per byte), so the cut text
    still makes more than `max_tokens` tokens; 16 tokens to spare for the frame."""
    longest = _LONGEST.get(tokenizer)
    if longest is None:
        longest = _LONGEST[tokenizer] = max(1, max((len(t) for t in tokenizer.get_vocab()), default=1))
    return (max_tokens + 16) * longest


_LONGEST: "weakref.WeakKeyDictionary[Any, int]" = weakref.WeakKeyDictionary()


def load_tokenizer(path: str | os.PathLike, key: str = "task.tokenizer_path") -> Any:
    """A Hugging Face tokenizer from a local folder; never the hub."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{key}: folder not found: '{path}' (a local tokenizer folder, as written by "
                                f"save_pretrained; nothing is downloaded)")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(os.fspath(path), local_files_only=True)
    except (OSError, ValueError) as e:
        raise ValueError(f"{key}: '{path}' holds no loadable tokenizer ({type(e).__name__}: {e})") from e

