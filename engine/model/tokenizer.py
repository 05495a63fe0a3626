"""Tokenizer access through the ``tokenizers`` library, plus the byte-level tokenizer of ``tiny``."""
from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers
from tokenizers import AddedToken

from engine.model.errors import CheckpointError

EOS = "<|endoftext|>"
THINK_START, THINK_END = "<think>", "</think>"
TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"
CODE_FENCE = "```"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
TOOL_RESPONSE_START, TOOL_RESPONSE_END = "<tool_response>", "</tool_response>"
SPECIAL_TOKENS = (EOS, THINK_START, THINK_END, TOOL_CALL_START, TOOL_CALL_END)
# Qwen3.5's chat-template tokens, added after the fence so the older ids keep their values.
CHAT_TOKENS = (IM_START, IM_END, TOOL_RESPONSE_START, TOOL_RESPONSE_END)
# Qwen3.5's image tokens: an image is VISION_START, IMAGE_PAD per embedding row, VISION_END.
VISION_START, VISION_END, IMAGE_PAD = "<|vision_start|>", "<|vision_end|>", "<|image_pad|>"
VISION_TOKENS = (VISION_START, VISION_END, IMAGE_PAD)

# model attribute -> token text
SPECIAL_ATTRIBUTES = {
    "eos_token_id": EOS,
    "think_start_id": THINK_START,
    "think_end_id": THINK_END,
    "tool_call_start_id": TOOL_CALL_START,
    "tool_call_end_id": TOOL_CALL_END,
    "code_fence_id": CODE_FENCE,
}


class Tokenizer:
    """Thin wrapper: text <-> ids, and the ids of the special tokens the scheduler watches."""

    def __init__(self, inner: HFTokenizer):
        self.inner = inner

    @property
    def vocab_size(self) -> int:
        return self.inner.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self.inner.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.inner.decode(ids, skip_special_tokens=False)

    def token_id(self, text: str) -> int | None:
        return self.inner.token_to_id(text)

    def assign_special_ids(self, model) -> None:
        """Set the special-token attributes of ``model`` for the tokens this tokenizer has."""
        for attribute, text in SPECIAL_ATTRIBUTES.items():
            token = self.token_id(text)
            if token is not None:
                setattr(model, attribute, token)


def load_tokenizer(directory: Path) -> Tokenizer | None:
    """The directory's tokenizer.json, or None when it has none (ids-only use still works)."""
    path = directory / "tokenizer.json"
    if not path.is_file():
        return None
    try:
        return Tokenizer(HFTokenizer.from_file(str(path)))
    except Exception as err:  # tokenizers raises a bare Exception on malformed files
        raise CheckpointError(f"{path}: unreadable tokenizer ({err})") from None


def build_byte_tokenizer(extra_special: tuple[str, ...] = ()) -> HFTokenizer:
    """256 byte tokens (ids 0..255, GPT-2 byte-to-unicode alphabet, no merges) + special tokens
    (``extra_special`` after the chat tokens: ``tiny-vl``'s vision tokens)."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_chars = sorted(alphabet, key=_byte_of)
    vocab = {char: i for i, char in enumerate(byte_chars)}
    inner = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    inner.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    inner.decoder = decoders.ByteLevel()
    inner.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    # The fence is a plain added token: it is matched inside ordinary text and kept on decode.
    inner.add_tokens([AddedToken(CODE_FENCE, special=False, normalized=False)])
    inner.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in CHAT_TOKENS + extra_special])
    return inner


def _byte_of(char: str) -> int:
    """Invert GPT-2's byte-to-unicode map so token id == byte value."""
    code = ord(char)
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    if code in printable:
        return code
    others = [b for b in range(256) if b not in printable]
    return others[code - 256]
