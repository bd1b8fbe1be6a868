"""A GGUF file's byte-level BPE tokenizer (`tokenizer.ggml.model` "gpt2") and its ChatML chat template.

Built with Hugging Face's `tokenizers` (the `models` extra) rather than in Python: its BPE is the one the models'
own tokenizer.json files run, so merges, byte-level mapping and special-token matching need no code of their own
here, and it encodes a long prompt in microseconds. What llama.cpp calls the pre-tokenizer (`tokenizer.ggml.pre`:
how text is split before BPE) is a list of regexes, each splitting the pieces of the one before (llama-vocab.cpp's
`regex_exprs`); a name not in PRE_TOKENIZERS is refused rather than guessed.
"""

from __future__ import annotations

import re

from .dependencies import require

# GPT-2's split: contractions, letters, numbers, other symbols (each with one leading space), runs of spaces.
GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
# Llama 3's: case-insensitive contractions, numbers of up to three digits, newlines kept apart.
LLAMA3_REGEX = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Qwen2's: Llama 3's with every digit a piece of its own.
QWEN2_REGEX = LLAMA3_REGEX.replace(r"\p{N}{1,3}", r"\p{N}")

# tokenizer.ggml.pre -> the regexes applied in turn (llama-vocab.cpp's names and expressions)
PRE_TOKENIZERS = {
    "gpt-2": (GPT2_REGEX,),
    "smollm": (r"\p{N}", GPT2_REGEX),     # every digit alone, then GPT-2's split
    "llama-bpe": (LLAMA3_REGEX,),
    "qwen2": (QWEN2_REGEX,),
}
# Pre-tokenizers whose tokenizer.json takes a whole word that is in the vocabulary without merging it
IGNORE_MERGES = ("llama-bpe",)

def byte_tokens() -> list[str]:
    """GPT-2's bytes_to_unicode, in byte order: the 256 tokens a byte-level BPE vocabulary begins with (printable
    bytes stand for themselves, the others for chr(256 + k)). For writing such vocabularies (tests, benchmarks)."""
    printable = set(range(ord("!"), ord("~") + 1)) | set(range(ord("¡"), ord("¬") + 1)) | \
        set(range(ord("®"), ord("ÿ") + 1))
    out, extra = [], 0
    for b in range(256):
        out.append(chr(b) if b in printable else chr(256 + extra))
        extra += b not in printable
    return out


TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED = 3, 4   # gguf.TokenType: matched in text as a whole

CHATML_START, CHATML_END = "<|im_start|>", "<|im_end|>"
# A ChatML template that opens with a system message where the conversation has none
# (SmolLM2's); the template's newlines may be written as "\n" inside its string literals or be newlines.
DEFAULT_SYSTEM = re.compile(r"messages\[0\]\['role'\] != 'system'.*?\{\{\s*'<\|im_start\|>system(?:\\n|\n)(.*?)"
                            r"<\|im_end\|>(?:\\n|\n)'\s*\}\}", re.S)


class Tokenizer:
    """Text to token ids and back, with a GGUF's vocabulary, merges and pre-tokenizer.

    Parameters
    ----------
    tokens : list of str
        The vocabulary in byte-level form (GPT-2's bytes-to-unicode mapping: "Ġthe" is " the"), id order.
    merges : list of str
        "left right" pairs, highest priority first.
    pre : str
        The pre-tokenizer's name (tokenizer.ggml.pre), one of PRE_TOKENIZERS.
    token_types : list of int, optional
        gguf.TokenType per token: control (3) and user-defined (4) tokens are matched whole in text.
    bos_id, eos_id : int, optional
    add_bos : bool, default False
        Whether `encode` starts with bos_id.
    chat_template : str, optional
        The Jinja template (tokenizer.chat_template); ChatML ones are rendered by `chat`.
    """

    def __init__(self, tokens, merges, pre: str, token_types=None, bos_id: int | None = None,
                 eos_id: int | None = None, add_bos: bool = False, chat_template: str | None = None) -> None:
        if pre not in PRE_TOKENIZERS:
            raise ValueError(f"tokenizer.ggml.pre {pre!r} is not supported (supported: {', '.join(PRE_TOKENIZERS)})")
        require("tokenizers")
        from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
        from tokenizers import Tokenizer as BPETokenizer

        tokens = list(tokens)
        vocab = {t: i for i, t in enumerate(tokens)}
        pairs = [tuple(m.split(" ", 1)) for m in merges]
        bad = next((m for m, p in zip(merges, pairs) if len(p) != 2 or "".join(p) not in vocab), None)
        if bad is not None:
            raise ValueError(f"tokenizer.ggml.merges: {bad!r} is not two tokens whose join is in the vocabulary")
        self._bpe = BPETokenizer(models.BPE(vocab, pairs, ignore_merges=pre in IGNORE_MERGES))
        self._bpe.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in PRE_TOKENIZERS[pre]]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        self._bpe.decoder = decoders.ByteLevel()
        types = list(token_types) if token_types is not None else []
        self.special_ids = {i for i, t in enumerate(types) if t in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED)}
        self._bpe.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                                      for i in sorted(self.special_ids)])
        self.tokens, self.pre = tokens, pre
        self.bos_id, self.eos_id, self.add_bos = bos_id, eos_id, bool(add_bos)
        self.chat_template = chat_template

    @classmethod
    def from_gguf_metadata(cls, metadata: dict) -> "Tokenizer":
        """From a GGUF file's `tokenizer.*` metadata (name -> value)."""
        model = metadata.get("tokenizer.ggml.model")
        if model != "gpt2":
            raise ValueError(f"tokenizer.ggml.model {model!r} is not supported (supported: 'gpt2', byte-level BPE)")
        for key in ("tokenizer.ggml.merges", "tokenizer.ggml.pre"):
            if key not in metadata:
                raise ValueError(f"metadata {key} is missing")
        return cls(metadata["tokenizer.ggml.tokens"], metadata["tokenizer.ggml.merges"], metadata["tokenizer.ggml.pre"],
                   metadata.get("tokenizer.ggml.token_type"), metadata.get("tokenizer.ggml.bos_token_id"),
                   metadata.get("tokenizer.ggml.eos_token_id"), metadata.get("tokenizer.ggml.add_bos_token", False),
                   metadata.get("tokenizer.chat_template"))

    @property
    def vocab_size(self) -> int:
        return len(self.tokens)

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Token ids of text (special tokens written in it are matched whole); add_bos None: the file's choice."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, not {type(text).__name__}")
        ids = self._bpe.encode(text, add_special_tokens=False).ids
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            ids = [self.bos_id] + ids
        return ids

    def decode(self, ids, skip_special: bool = True) -> str:
        """The text of token ids; control and user-defined tokens left out with skip_special."""
        return self._bpe.decode([int(i) for i in ids], skip_special_tokens=skip_special)

    @property
    def stop_ids(self) -> set:
        """Ids that end a reply: eos, and ChatML's end of turn."""
        stops = {self.eos_id} if self.eos_id is not None else set()
        if CHATML_END in self.tokens:
            stops.add(self.tokens.index(CHATML_END))
        return stops

    def chat(self, messages) -> str:
        """The prompt for a conversation, rendered with the file's ChatML template, the assistant's turn opened.

        messages : str or list of {"role": str, "content": str}
            A str is one user message.
        """
        template = self.chat_template
        if not template or CHATML_START not in template:
            raise ValueError("tokenizer.chat_template is not ChatML (<|im_start|>role ... <|im_end|>); only ChatML "
                             "templates are rendered" if template else "the model has no tokenizer.chat_template")
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        default = DEFAULT_SYSTEM.search(template)
        if default and (not messages or messages[0]["role"] != "system"):
            messages = [{"role": "system", "content": default.group(1).replace("\\n", "\n")}] + list(messages)
        turns = "".join(f"{CHATML_START}{m['role']}\n{m['content']}{CHATML_END}\n" for m in messages)
        return turns + f"{CHATML_START}assistant\n"


class TextStream:
    """Decoding tokens as they come: `add(ids)` returns the text they complete. A UTF-8 character split over tokens
    (byte-level BPE splits them) is held back until its last byte arrives."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer, self.ids, self.shown = tokenizer, [], 0

    def add(self, ids) -> str:
        self.ids += [int(i) for i in ids]
        text = self.tokenizer.decode(self.ids)
        end = len(text)
        while end > self.shown and text[end - 1] == "\ufffd":   # an incomplete character, so far
            end -= 1
        new, self.shown = text[self.shown:end], max(self.shown, end)
        return new

    def flush(self) -> str:
        """What is held back (incomplete characters as U+FFFD) once no token follows."""
        text = self.tokenizer.decode(self.ids)
        new, self.shown = text[self.shown:], len(text)
        return new
