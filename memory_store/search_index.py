"""What makes a chat searchable: the words of a text as the search index holds them, and the writes that
index a message, a chat's title, or take a deleted chat or message out (each goes with the chat's or message's own
writes, in the owner's partition). The index and its queries: ``search.py``."""

from __future__ import annotations

import re
import unicodedata
import uuid

from memory_store.db import Cql, Write

# Distinct words indexed per text: bounds a message's index entries (a 32 KiB message has ~5,000 words).
MAX_DOCUMENT_TERMS = 2000
MAX_TERM_CHARS = 64

WORD = re.compile(r"\w+")

STATEMENTS = {
    # Messages are written once (a retry unions the same words): adding to the set writes no tombstone.
    "search_add": Cql(
        "UPDATE chat_search SET role = :role, text = :text, terms = terms + :terms "
        "WHERE user_id = :user_id AND chat_id = :chat_id AND item_id = :item_id",
        True,
    ),
    # A title is replaced on rename (one collection tombstone per rename).
    "search_set_title": Cql(
        "UPDATE chat_search SET role = 'title', text = :text, terms = :terms "
        "WHERE user_id = :user_id AND chat_id = :chat_id AND item_id = :item_id",
        True,
    ),
    "search_delete_item": Cql(
        "DELETE FROM chat_search WHERE user_id = :user_id AND chat_id = :chat_id AND item_id = :item_id", True
    ),
    "search_delete_chat": Cql(
        "DELETE FROM chat_search WHERE user_id = :user_id AND chat_id = :chat_id", True
    ),
}


def search_terms(text: str, limit: int = MAX_DOCUMENT_TERMS) -> list[str]:
    """The distinct words of ``text`` as the index holds them, in order of first appearance."""
    words = WORD.findall(unicodedata.normalize("NFKC", text).casefold())
    return list(dict.fromkeys(word for word in words if len(word) <= MAX_TERM_CHARS))[:limit]


def index_write(user_id: str, chat_key: uuid.UUID, item_key: uuid.UUID, role: str, text: str) -> Write:
    """The write that makes a message searchable (run it with the message's own write)."""
    return "search_add", {
        "role": role,
        "text": text,
        "terms": set(search_terms(text)),
        "user_id": user_id,
        "chat_id": chat_key,
        "item_id": item_key,
    }


def title_write(user_id: str, chat_key: uuid.UUID, title: str) -> Write:
    """The write that makes a chat's (new) title searchable; it lives in the user's partition."""
    values = {"text": title, "terms": set(search_terms(title))}
    return "search_set_title", {**values, "user_id": user_id, "chat_id": chat_key, "item_id": chat_key}


def delete_write(user_id: str, chat_key: uuid.UUID) -> Write:
    """The write that takes a deleted chat out of search; it lives in the user's partition."""
    return "search_delete_chat", {"user_id": user_id, "chat_id": chat_key}


def item_delete_write(user_id: str, chat_key: uuid.UUID, item_key: uuid.UUID) -> Write:
    """The write that takes a deleted message out of search."""
    return "search_delete_item", {"user_id": user_id, "chat_id": chat_key, "item_id": item_key}
