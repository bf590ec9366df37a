"""The model's tokenizer and chat template: defined once, imported by the orchestrator and every engine.

Built from a GGUF file's own metadata (vocab, merges, control tokens, Jinja chat template), or from a
Hugging Face model directory (``tokenizer.json``, ``tokenizer_config.json``'s ``chat_template``,
``generation_config.json``), so the orchestrator renders and counts prompts exactly as the engine will
see them. A directory converted from a GGUF (``engine.model.convert_gguf_to_hf``) yields the same
tokenizer, the same model name and the same fingerprint as the GGUF. The ``fingerprint``
identifies vocab + merges + template; engines advertise it and refuse prompts tokenized with another.
Two tokenizer models: byte-level BPE with SmolLM's pre-tokenizer (``tokenizers``), and SentencePiece
from a GGUF's scores with byte fallback (``chatmesh.sentencepiece``, llama.cpp's "llama" model: Gemma).
The file chooses. A file naming another tokenizer is refused at load, naming what differs, since it
would load and split text into ids the model never saw. A base model has no chat template: it
tokenizes plain prompts (completions) and refuses chats with a message saying so.

Prompt-injection safety: text from users is tokenized with special-token matching off, so typing
``<|im_end|>`` in a message yields ordinary text tokens, never a control token. Only the chat
template's own markup produces control tokens.
"""

from __future__ import annotations

import functools
import hashlib
import json
import uuid
from array import array
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, decoders, models, pre_tokenizers

from chatmesh.gguf_header import read_gguf_metadata
from chatmesh.model_files import bundled_model_path
from chatmesh.sentencepiece import TYPE_CONTROL, SentencePieceCodec


@dataclass(frozen=True)
class ChatMessage:
    role: str  # "system" | "user" | "assistant"
    content: str


# Distinct strings of template markup whose ids a tokenizer keeps (``encode_chat``).
MARKUP_CACHE_SIZE = 256


class ChatTokenizer:
    """Tokenizer, detokenizer and chat template of one model."""

    def __init__(
        self,
        model_name: str,
        codec: TokenCodec,
        identity: Sequence[str],
        chat_template: str | None,
        bos_token_id: int,
        eos_token_ids: Sequence[int],
        add_bos: bool = False,
    ) -> None:
        """``identity``: the strings that define the codec (vocabulary, merges or scores and types),
        hashed into the fingerprint with the template and the special ids. ``add_bos``: a prompt
        starts with the BOS token (``encode_prompt``); a chat template writes its own."""
        self.model_name = model_name
        self.vocab_size = codec.vocab_size
        self.bos_token_id = bos_token_id
        self.eos_token_ids = tuple(eos_token_ids)
        self.add_bos = add_bos
        self.chat_template = chat_template
        self._codec = codec
        self._template = (
            None
            if chat_template is None
            else ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(
                chat_template
            )
        )
        # Every prompt repeats the template's markup around its messages (a few distinct strings): their
        # ids are kept rather than encoded for every message of every prompt.
        self._markup_ids = functools.lru_cache(maxsize=MARKUP_CACHE_SIZE)(self._encode_markup)
        digest = hashlib.sha256()
        for part in (
            *identity,
            "\x00",
            chat_template or "",
            str(bos_token_id),
            str(self.eos_token_ids),
            *(["add_bos"] if add_bos else []),  # absent when off, so BPE fingerprints stay as they were
        ):
            digest.update(part.encode("utf-8") + b"\x1f")
        self.fingerprint = f"{model_name}:{digest.hexdigest()[:16]}"

    @classmethod
    def from_gguf(cls, path: str | Path) -> ChatTokenizer:
        metadata = read_gguf_metadata(path)
        field = metadata.get
        _refuse_other_gguf_tokenizers(path, metadata)

        def required(key: str) -> Any:
            value = metadata.get(key)
            if value is None:
                raise ValueError(f"{path}: the tokenizer needs {key}, which the file lacks")
            return value

        tokens = required("tokenizer.ggml.tokens")
        token_types = required("tokenizer.ggml.token_type")
        # ChatML models end a turn with <|im_end|> and a document with <|endoftext|>; GGUFs name only one.
        eos_ids = [required("tokenizer.ggml.eos_token_id")]
        eos_ids += [tokens.index(t) for t in ("<|im_end|>", "<|endoftext|>") if t in tokens]
        eos_ids = list(dict.fromkeys(eos_ids))
        codec: TokenCodec
        if metadata["tokenizer.ggml.model"] == "llama":
            scores = required("tokenizer.ggml.scores")
            codec = SentencePieceCodec(
                tokens,
                scores,
                token_types,
                field("tokenizer.ggml.unknown_token_id"),
                # llama.cpp's default for SentencePiece when the file does not say
                add_space_prefix=bool(field("tokenizer.ggml.add_space_prefix", True)),
            )
            identity = ["sentencepiece", *tokens, "\x00", *map(repr, scores), "\x00", *map(str, token_types)]
            identity.append(f"add_space_prefix={codec.add_space_prefix}")
            add_bos_default = True
        else:
            merges = required("tokenizer.ggml.merges")
            control_ids = [i for i, kind in enumerate(token_types) if kind == TYPE_CONTROL]
            codec = BpeCodec(tokens, merges, control_ids)
            identity = [*tokens, "\x00", *merges]
            add_bos_default = False
        return cls(
            model_name=model_name(field("general.basename"), field("general.size_label"), path),
            codec=codec,
            identity=identity,
            chat_template=field("tokenizer.chat_template"),
            bos_token_id=required("tokenizer.ggml.bos_token_id"),
            eos_token_ids=eos_ids,
            add_bos=bool(field("tokenizer.ggml.add_bos_token", add_bos_default)),
        )

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> ChatTokenizer:
        """The tokenizer of a Hugging Face model directory (byte-level BPE ``tokenizer.json`` only)."""
        path = Path(path)
        spec = json.loads((path / "tokenizer.json").read_text())
        settings = _read_json(path / "tokenizer_config.json")
        config = _read_json(path / "config.json")
        generation = {**config, **_read_json(path / "generation_config.json")}
        _refuse_other_hf_tokenizers(path / "tokenizer.json", spec)
        by_id = {i: token for token, i in spec["model"]["vocab"].items()}
        by_id.update({added["id"]: added["content"] for added in spec.get("added_tokens", [])})
        tokens = [by_id[i] for i in range(len(by_id))]
        control_ids = [added["id"] for added in spec.get("added_tokens", []) if added.get("special")]
        merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
        template = settings.get("chat_template")
        if not isinstance(template, str):
            raise ValueError(f"{path}/tokenizer_config.json: chat_template (a Jinja string) is missing")

        def token_id(key: str) -> list[int]:
            value = generation.get(f"{key}_token_id")
            if value is None and isinstance(settings.get(f"{key}_token"), str):
                value = tokens.index(settings[f"{key}_token"])
            return [] if value is None else [value] if isinstance(value, int) else list(value)

        bos = token_id("bos")
        # The GGUF rule: ChatML models end a turn with <|im_end|> and a document with <|endoftext|>.
        eos_ids = token_id("eos") + [tokens.index(t) for t in ("<|im_end|>", "<|endoftext|>") if t in tokens]
        return cls(
            model_name=hf_model_name(path, config),
            codec=BpeCodec(tokens, merges, control_ids),
            identity=[*tokens, "\x00", *merges],
            chat_template=template,
            bos_token_id=bos[0] if bos else eos_ids[0],
            eos_token_ids=list(dict.fromkeys(eos_ids)),
        )

    def save_hf_files(self, directory: str | Path) -> None:
        """Writes ``tokenizer.json`` and ``tokenizer_config.json`` (with the chat template) so that
        ``from_hf_dir`` (and Hugging Face's own loaders) rebuild this tokenizer."""
        if not isinstance(self._codec, BpeCodec) or self.chat_template is None:
            raise ValueError(
                f"{self.model_name}: only a byte-level BPE tokenizer with a chat template is written as "
                "Hugging Face files"
            )
        directory = Path(directory)
        (directory / "tokenizer.json").write_text(self._codec.markup.to_str(pretty=True))
        name = self._codec.markup.id_to_token
        settings = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "chat_template": self.chat_template,
            "bos_token": name(self.bos_token_id),
            "eos_token": name(self.eos_token_ids[0]),
            "add_bos_token": False,
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
        }
        (directory / "tokenizer_config.json").write_text(json.dumps(settings, indent=2, ensure_ascii=False))

    def tokenizer_json(self) -> str:
        """The tokenizer as Hugging Face's ``tokenizer.json`` text (what grammar libraries load)."""
        if not isinstance(self._codec, BpeCodec):
            raise ValueError(
                f"{self.model_name} has a SentencePiece tokenizer: constrained output is served for byte-level "
                "BPE tokenizers only"
            )
        return self._codec.markup.to_str()

    # -- text <-> ids --------------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        """Token ids of plain text; control-token strings in it are not recognised."""
        return self._codec.encode(text, parse_special=False)

    def encode_prompt(self, text: str) -> list[int]:
        """Token ids of a completion prompt: BOS first where the model wants it, then ``text`` as plain
        text (llama.cpp's ``tokenize(text, add_special=True, parse_special=False)``)."""
        return ([self.bos_token_id] if self.add_bos else []) + self.encode(text)

    def decode(self, token_ids: Sequence[int], skip_control: bool = True) -> str:
        """Text of ``token_ids``. Bytes of an incomplete UTF-8 character decode to U+FFFD."""
        return self._codec.decode(token_ids, skip_control)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes ``token_id`` stands for: a byte-level token may hold part of a UTF-8 character, so
        its bytes, not its text, are what it is (OpenAI's logprobs report them as ``bytes``)."""
        return self._codec.token_bytes(token_id)

    # -- chat template -------------------------------------------------------------------------------

    def render(
        self, messages: Sequence[ChatMessage | Mapping[str, str]], add_generation_prompt: bool = True
    ) -> str:
        """The prompt text the model's own chat template makes of ``messages``."""
        return self._chat_template().render(
            messages=[_as_dict(m) for m in messages],
            add_generation_prompt=add_generation_prompt,
            bos_token="",
            eos_token="",
        )

    def encode_chat(
        self,
        messages: Sequence[ChatMessage | Mapping[str, str]],
        add_generation_prompt: bool = True,
        encode_content: Callable[[str], Sequence[int]] | None = None,
    ) -> list[int]:
        """Prompt token ids for ``messages``: template markup may yield control tokens, contents never do.
        ``encode_content`` encodes each content (default: ``encode``; ``PromptEncoder`` remembers them)."""
        encode = encode_content or self.encode
        sentinels = [f"\x00{uuid.uuid4().hex}\x00" for _ in messages]
        placeholders = [
            {"role": _as_dict(m)["role"], "content": sentinel}
            for m, sentinel in zip(messages, sentinels, strict=True)
        ]
        skeleton = self._chat_template().render(
            messages=placeholders, add_generation_prompt=add_generation_prompt, bos_token="", eos_token=""
        )
        ids: list[int] = []
        for message, sentinel in zip(messages, sentinels, strict=True):
            before, found, skeleton = skeleton.partition(sentinel)
            if not found:
                raise ValueError("the chat template dropped a message's content")
            ids += self._markup_ids(before)
            ids += encode(_as_dict(message)["content"])
        ids += self._markup_ids(skeleton)
        return ids

    def user_turn_after_answer(self, content: str) -> list[int]:
        """The ids that follow an assistant's answer to go on with a user turn holding ``content``, up to
        the next answer's start: the template's end of the answer, the user turn (``content`` encoded
        as text: it never yields a control token), and the assistant's header. A tool's result goes
        back to the model so, after the tokens of the answer that called it."""
        answer, user = (f"\x00{uuid.uuid4().hex}\x00" for _ in range(2))
        skeleton = self._chat_template().render(
            messages=[
                {"role": "user", "content": "?"},
                {"role": "assistant", "content": answer},
                {"role": "user", "content": user},
            ],
            add_generation_prompt=True,
            bos_token="",
            eos_token="",
        )
        between, found, rest = skeleton.partition(answer)[2].partition(user)
        if not found:
            raise ValueError("the chat template dropped a message's content")
        return [*self._markup_ids(between), *self.encode(content), *self._markup_ids(rest)]

    def _chat_template(self) -> Any:
        if self._template is None:
            raise NoChatTemplate(
                f"{self.model_name} has no chat template (a base model): it completes prompts "
                "(/v1/completions) and takes no chats"
            )
        return self._template

    def _encode_markup(self, text: str) -> tuple[int, ...]:
        return tuple(self._codec.encode(text, parse_special=True))


class NoChatTemplate(ValueError):
    """A chat was asked of a model without a chat template."""


class TokenCodec(Protocol):
    """Text <-> ids of one tokenizer model; ``parse_special``: control-token strings become tokens."""

    vocab_size: int

    def encode(self, text: str, parse_special: bool) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_control: bool) -> str: ...

    def token_bytes(self, token_id: int) -> bytes: ...


class BpeCodec:
    """Byte-level BPE with SmolLM's pre-tokenizer, on ``tokenizers``."""

    def __init__(self, tokens: Sequence[str], merges: Sequence[str], control_ids: Sequence[int]) -> None:
        self.vocab_size = len(tokens)
        self.markup = _build_bpe(tokens, merges, control_ids)
        self._control_ids = frozenset(control_ids)
        # Same vocabulary, but control-token strings in the input stay plain text.
        self._plain = _build_bpe(tokens, merges, control_ids)
        self._plain.encode_special_tokens = True

    def encode(self, text: str, parse_special: bool) -> list[int]:
        return (self.markup if parse_special else self._plain).encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], skip_control: bool) -> str:
        return self.markup.decode(list(ids), skip_special_tokens=skip_control)

    def token_bytes(self, token_id: int) -> bytes:
        piece = self.markup.id_to_token(token_id)
        if piece is None:
            return b""
        if token_id in self._control_ids or any(c not in _BYTE_OF_CHAR for c in piece):
            return piece.encode("utf-8")
        return bytes(_BYTE_OF_CHAR[c] for c in piece)


class EncodedTexts:
    """Texts encoded lately and their ids, the least recently used dropped past ``max_tokens`` ids in
    all. A chat's prompt is assembled again at every send from the same stored messages, which never
    change: kept here, only the new ones are encoded. A text's ids take 4 bytes a token (beside the
    text itself, which its ids' count bounds too: a token is a few characters)."""

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self.tokens = 0
        self._ids: OrderedDict[str, array[int]] = OrderedDict()

    def get(self, text: str) -> array[int] | None:
        ids = self._ids.get(text)
        if ids is not None:
            self._ids.move_to_end(text)
        return ids

    def add(self, text: str, ids: array[int]) -> None:
        if len(ids) > self.max_tokens or text in self._ids:
            return
        self._ids[text] = ids
        self.tokens += len(ids)
        while self.tokens > self.max_tokens:
            _, dropped = self._ids.popitem(last=False)
            self.tokens -= len(dropped)


class PromptEncoder:
    """``encode`` and ``encode_chat`` for the assembly of one prompt, which tries several subsets of the
    same messages (the newest turns that fit): each content is encoded once, whatever the subsets, and
    not at all when ``recent`` (kept across prompts) has it. It keeps what it encoded, so it lives as
    long as one assembly."""

    def __init__(self, tokenizer: ChatTokenizer, recent: EncodedTexts | None = None) -> None:
        self.tokenizer = tokenizer
        self.recent = recent
        self._contents: dict[str, array[int]] = {}

    def encode(self, text: str) -> array[int]:
        ids = self._contents.get(text)
        if ids is None:
            ids = self.recent.get(text) if self.recent is not None else None
            if ids is None:
                ids = array("I", self.tokenizer.encode(text))
                if self.recent is not None:
                    self.recent.add(text, ids)
            self._contents[text] = ids
        return ids

    def encode_chat(self, messages: Sequence[ChatMessage | Mapping[str, str]]) -> list[int]:
        return self.tokenizer.encode_chat(messages, encode_content=self.encode)


def _as_dict(message: ChatMessage | Mapping[str, str]) -> dict[str, str]:
    if isinstance(message, ChatMessage):
        return {"role": message.role, "content": message.content}
    return {"role": message["role"], "content": message["content"]}


def _byte_level_alphabet() -> dict[str, int]:
    """The byte each character of a byte-level BPE token stands for (GPT-2's printable mapping: bytes
    that print as themselves keep their character, the others take the characters from U+0100 on)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars = {byte: chr(byte) for byte in printable}
    others = (byte for byte in range(256) if byte not in chars)
    chars.update({byte: chr(256 + n) for n, byte in enumerate(others)})
    return {char: byte for byte, char in chars.items()}


_BYTE_OF_CHAR = _byte_level_alphabet()


def _build_bpe(
    tokens: Sequence[str], merges: Sequence[str], control_ids: Sequence[int]
) -> tokenizers.Tokenizer:
    bpe = models.BPE(
        vocab={token: i for i, token in enumerate(tokens)},
        merges=[(left, right) for left, right in (merge.split(" ", 1) for merge in merges)],
    )
    tok = tokenizers.Tokenizer(bpe)
    tok.pre_tokenizer = _pre_tokenizer()
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i in control_ids])
    return tok


# The GGUF tokenizers chatmesh implements, as (tokenizer.ggml.model, tokenizer.ggml.pre) in llama.cpp's
# names: SmolLM's byte-level BPE (``_build_bpe``) and SentencePiece (``chatmesh.sentencepiece``), which
# llama.cpp runs without a pre-tokenizer ("default", or none named). Any other loads without error and
# splits text into ids the model never saw, so it is refused here, at start; a tokenizer.json spells
# its own out.
_GGUF_TOKENIZERS = {("gpt2", "smollm"), ("llama", "default"), ("llama", None)}
# tokenizer.json BPE options that change the ids; ours has each off.
_BPE_OPTIONS = (
    "dropout",
    "continuing_subword_prefix",
    "end_of_word_suffix",
    "byte_fallback",
    "ignore_merges",
)
_OURS = "byte-level BPE, digits split one by one, then GPT-2 byte-level pre-tokenization"


def _refuse_other_gguf_tokenizers(path: str | Path, metadata: Mapping[str, object]) -> None:
    found = (metadata.get("tokenizer.ggml.model"), metadata.get("tokenizer.ggml.pre"))
    if found not in _GGUF_TOKENIZERS:
        said = ", ".join(
            f"{key} {'is not set' if value is None else f'is {value!r}'}"
            for key, value in zip(("tokenizer.ggml.model", "tokenizer.ggml.pre"), found, strict=True)
        )
        raise ValueError(
            f"{path}: unsupported tokenizer: {said}; chatmesh implements 'gpt2' with pre-tokenizer 'smollm' "
            f"(SmolLM's: {_OURS}) and 'llama' (SentencePiece with byte fallback, pre-tokenizer 'default')"
        )


def _refuse_other_hf_tokenizers(path: Path, spec: Mapping[str, Any]) -> None:
    model, decoder = spec.get("model") or {}, spec.get("decoder") or {}
    if model.get("type") != "BPE" or decoder.get("type") != "ByteLevel":
        raise ValueError(
            f"{path}: unsupported tokenizer: model {model.get('type')!r} with decoder "
            f"{decoder.get('type')!r}; chatmesh implements only {_OURS}"
        )
    if spec.get("normalizer") is not None:
        raise ValueError(
            f"{path}: unsupported tokenizer: normalizer {json.dumps(spec['normalizer'])}; chatmesh "
            f"implements only {_OURS}, without a normalizer"
        )
    if options := [option for option in _BPE_OPTIONS if model.get(option)]:
        raise ValueError(
            f"{path}: unsupported tokenizer: BPE {', '.join(options)} set; chatmesh implements none"
        )
    probe = tokenizers.Tokenizer(models.BPE())
    probe.pre_tokenizer = _pre_tokenizer()
    ours = json.loads(probe.to_str())["pre_tokenizer"]
    if _without_offsets(spec.get("pre_tokenizer")) != _without_offsets(ours):
        raise ValueError(
            f"{path}: unsupported tokenizer: pre-tokenizer {json.dumps(spec.get('pre_tokenizer'))} differs "
            f"from the one chatmesh implements ({_OURS})"
        )


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def _without_offsets(spec: object) -> object:
    """A pre-tokenizer spec without ``trim_offsets``, which changes offsets but never token ids."""
    if isinstance(spec, dict):
        return {k: _without_offsets(v) for k, v in spec.items() if k != "trim_offsets"}
    if isinstance(spec, list):
        return [_without_offsets(v) for v in spec]
    return spec


def hf_model_name(path: str | Path, config: Mapping[str, object]) -> str:
    """The served name of a Hugging Face directory: the last part of ``config.json``'s
    ``_name_or_path`` when set, else the directory's name. Engines and the tokenizer must agree on it."""
    return Path(str(config.get("_name_or_path") or Path(path).resolve().name)).name


def _pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    """SmolLM's pre-tokenizer (llama.cpp "smollm"): digits one by one, then GPT-2 byte-level splitting."""
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )


def model_name(basename: object, size_label: object, path: str | Path) -> str:
    """The served model's name from GGUF metadata; engines and the tokenizer must agree on it."""
    if basename == "smollm2" and size_label == "135M":
        return "SmolLM2-135M-Instruct"
    return Path(path).stem


# The tokenizers loaded in this process, one per fingerprint: a GGUF and the directory converted from it
# (same vocabulary, template and name) share one, whichever path loaded it.
_LOADED: dict[str, ChatTokenizer] = {}


@functools.cache
def load_tokenizer(path: str | None = None) -> ChatTokenizer:
    """The tokenizer of the GGUF file or Hugging Face directory at ``path`` (default: the bundled
    SmolLM2 GGUF), loaded once per path and kept once per fingerprint in this process."""
    if path is not None and Path(path).is_dir():
        tokenizer = ChatTokenizer.from_hf_dir(path)
    else:
        tokenizer = ChatTokenizer.from_gguf(path or bundled_model_path())
    return _LOADED.setdefault(tokenizer.fingerprint, tokenizer)
