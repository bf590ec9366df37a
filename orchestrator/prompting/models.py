"""The models a replica serves: per model its tokenizer, context window, kind and licence, and the
Prompter that fits its prompts; a request naming any other model is refused before anything is stored.

Each model's prompts are rendered with its own chat template and counted with its own tokenizer, and
encoded texts are kept per tokenizer fingerprint, so two tokenizers never share token ids or counts. A
model whose file has no chat template (a base model such as Gemma 3 270M) is a completion model: it
continues prompts (Complete with ``prompt``, ``/v1/completions``) and takes no chats.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

from chatmesh import limits
from chatmesh.chat.v1 import chat_pb2
from chatmesh.errors import ServiceError, invalid
from chatmesh.limits import Generation, Limits
from chatmesh.model_files import bundled_model_path, model_context_length, model_licence
from chatmesh.tokenizer import ChatTokenizer, EncodedTexts, load_tokenizer
from memory_store.store import MemoryStore
from orchestrator.config import PromptConfig
from orchestrator.policy.refusals import checked, refused
from orchestrator.prompting.prompter import Prompter

CHAT, COMPLETION = "chat", "completion"


def kind_of(tokenizer: ChatTokenizer) -> str:
    """A model with a chat template takes chats; one without (a base model) completes prompts."""
    return CHAT if tokenizer.chat_template is not None else COMPLETION


@dataclass(frozen=True)
class ModelFile:
    """A served model's file and the name requests give it (its tokenizer's model name by default)."""

    path: Path
    name: str = ""

    @classmethod
    def parse(cls, flag: str) -> ModelFile:
        """``--model-file``'s ``PATH`` or ``NAME=PATH``."""
        name, sep, path = flag.partition("=")
        return cls(Path(path), name) if sep and name and not Path(flag).exists() else cls(Path(flag))


@dataclass(frozen=True)
class ServedModel:
    name: str
    tokenizer: ChatTokenizer
    context_window: int
    licence: str
    prompter: Prompter

    @property
    def kind(self) -> str:
        return kind_of(self.tokenizer)


@dataclass(frozen=True)
class ModelSpec:
    """What a model file says about the model: read before the replica connects to anything, so that a
    file it cannot serve stops it at once."""

    name: str
    tokenizer: ChatTokenizer
    context_window: int  # as the file declares it
    licence: str

    @property
    def kind(self) -> str:
        return kind_of(self.tokenizer)

    def window(self, config: PromptConfig) -> int:
        """The context window its prompts fit: the file's, capped by ``--context-window``."""
        return min(config.context_window or self.context_window, self.context_window)

    @classmethod
    def load(cls, file: ModelFile) -> ModelSpec:
        """ValueError or OSError for a file or tokenizer it cannot serve."""
        tokenizer = load_tokenizer(str(file.path))
        return cls(
            file.name or tokenizer.model_name,
            tokenizer,
            model_context_length(file.path),
            model_licence(file.path),
        )


def model_files(flags: Sequence[str]) -> list[ModelFile]:
    """The ``--model-file`` flags, or the bundled model when none is given."""
    return [ModelFile.parse(flag) for flag in flags] or [ModelFile(bundled_model_path())]


def default_model(specs: Sequence[ModelSpec], default: str) -> str:
    """The model of requests that name none: ``default``, or the first chat model (ValueError for
    ``default`` not served, or two files under one name)."""
    names = [spec.name for spec in specs]
    if not names:
        raise ValueError("no model to serve")
    if len(set(names)) != len(names):
        raise ValueError(
            f"two model files serve the same model name ({', '.join(names)}): name one NAME=PATH"
        )
    if default and default not in names:
        raise ValueError(f"--default-model {default!r} is none of the served models ({', '.join(names)})")
    chat = [spec.name for spec in specs if spec.kind == CHAT]
    if default and default not in chat:
        raise ValueError(f"--default-model {default!r} is a completion model; the default one takes chats")
    return default or (chat[0] if chat else names[0])


class Models:
    """The served models by name, and the one requests that name none get."""

    def __init__(self, by_name: dict[str, ServedModel], default: str) -> None:
        self.by_name = by_name
        self.default = default

    @classmethod
    def over(
        cls, store: MemoryStore, specs: Sequence[ModelSpec], config: PromptConfig, default: str = ""
    ) -> Models:
        """The models of ``specs``, each prompted within its window (at most ``config``'s)."""
        served = {}
        # Encoded texts are kept per tokenizer: models of one tokenizer (a pool and its -lite twin) share
        # them, models of two never do.
        recent: dict[str, EncodedTexts] = {}
        for spec in specs:
            window = spec.window(config)
            cache = None
            if config.encoded_cache_tokens:
                cache = recent.setdefault(
                    spec.tokenizer.fingerprint, EncodedTexts(config.encoded_cache_tokens)
                )
            prompter = Prompter(spec.name, store, spec.tokenizer, config, window, cache)
            served[spec.name] = ServedModel(spec.name, spec.tokenizer, window, spec.licence, prompter)
        return cls(served, default_model(specs, default))

    def names(self) -> str:
        return ", ".join(sorted(self.by_name))

    def get(self, name: str, field: str = "options.model") -> ServedModel:
        """The model ``name`` (empty: the default); NOT_FOUND naming the served ones for another
        (``field``: the request's field naming it)."""
        model = self.by_name.get(name or self.default)
        if model is None:
            raise refused(
                ServiceError(
                    grpc.StatusCode.NOT_FOUND,
                    f"model {name!r} not found; served models: {self.names()}",
                    field=field,
                )
            )
        return model

    def for_chat(self, name: str, field: str = "options.model") -> ServedModel:
        """``get``, refusing a completion model (INVALID_ARGUMENT): it has no chat template to render
        turns with."""
        model = self.get(name, field)
        if model.kind != CHAT:
            raise refused(
                invalid(
                    field,
                    f"{model.name} is a completion model (a base model without a chat template): it "
                    "continues prompts (/v1/completions) and takes no chats; chat with "
                    f"{self.default if self.by_name[self.default].kind == CHAT else 'a chat model'}",
                )
            )
        return model

    def resolve(
        self, options: chat_pb2.GenerationOptions, limits_: Limits, chat: bool
    ) -> tuple[ServedModel, Generation]:
        """The model a request's ``options`` name (``chat``: one that takes chats) and its options
        checked against the limits and that model's vocabulary, defaults applied."""
        checked(limits.generation, options, limits_, self.default)  # the name's length first
        model = self.for_chat(options.model) if chat else self.get(options.model)
        return model, checked(limits.generation, options, limits_, model.name, model.tokenizer.vocab_size)
