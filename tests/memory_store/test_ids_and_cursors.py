"""Pure logic: time-sortable ids, signed cursors, and the store's flags (no Cassandra needed)."""

import uuid
from datetime import UTC, datetime, timedelta

import pytest

from memory_store.config import StoreConfig, parse_replication
from memory_store.cursor import CursorCodec
from memory_store.errors import InvalidArgument
from memory_store.ids import id_time, new_id, parse_id
from memory_store.messages import bucket_of
from meshkit.config import ServiceArgs, from_flags


def test_ids_made_now_are_unique_and_strictly_increasing_in_time():
    ids = [new_id() for _ in range(10_000)]
    assert len(set(ids)) == len(ids)
    times = [i.time for i in ids]
    assert times == sorted(times) and len(set(times)) == len(times)
    assert all(i.version == 1 and i.variant == uuid.RFC_4122 for i in ids)


def test_id_carries_its_time_and_day_bucket():
    at = datetime(2026, 3, 1, 23, 59, 59, 123456, tzinfo=UTC)
    made = new_id(at)
    assert id_time(made) == at
    assert bucket_of(made) + 1 == bucket_of(new_id(at + timedelta(seconds=1)))
    # Two ids of the same instant made on different replicas do not collide.
    assert new_id(at) != made


def test_only_time_based_uuids_are_accepted_as_ids():
    assert parse_id(str(new_id()), "id").version == 1
    for bad in ("", "x", str(uuid.uuid4()), "00000000-0000-0000-0000-000000000000"):
        with pytest.raises(InvalidArgument):
            parse_id(bad, "chat id")


def test_cursor_round_trips_only_for_its_kind_and_scope():
    codec = CursorCodec(b"k" * 32)
    cursor = codec.encode("messages", "alice/chat-1", ["6f0c4d1e-0000-1000-8000-000000000000"])
    assert codec.decode(cursor, "messages", "alice/chat-1") == ["6f0c4d1e-0000-1000-8000-000000000000"]
    for kind, scope in [("messages", "bob/chat-1"), ("messages", "alice/chat-2"), ("chats", "alice/chat-1")]:
        with pytest.raises(InvalidArgument):
            codec.decode(cursor, kind, scope)
    with pytest.raises(InvalidArgument):
        CursorCodec(b"z" * 32).decode(cursor, "messages", "alice/chat-1")


def test_every_single_character_change_to_a_cursor_is_refused():
    codec = CursorCodec(b"k" * 32)
    cursor = codec.encode("chats", "alice", [1_700_000_000_000, "6f0c4d1e-0000-1000-8000-000000000000"])
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"
    for i, char in enumerate(cursor):
        changed = cursor[:i] + alphabet[(alphabet.index(char) + 1) % len(alphabet)] + cursor[i + 1 :]
        with pytest.raises(InvalidArgument):
            codec.decode(changed, "chats", "alice")


def test_store_flags_read_contact_points_and_replication():
    args = ServiceArgs("orchestrator", "test")
    args.add_config(StoreConfig)
    config = from_flags(
        StoreConfig,
        args.parse(
            [
                "--cassandra",
                "10.0.0.1:9142",
                "--cassandra",
                "10.0.0.2:9142",
                "--cassandra-replication",
                "NetworkTopologyStrategy:dc1=3,dc2=3",
            ]
        ),
    )
    assert (config.contact_points, config.port) == (("10.0.0.1", "10.0.0.2"), 9142)
    assert config.replication == {"class": "NetworkTopologyStrategy", "dc1": 3, "dc2": 3}
    assert from_flags(StoreConfig, args.parse([])).contact_points == ("127.0.0.1",)
    assert parse_replication("SimpleStrategy:1") == {"class": "SimpleStrategy", "replication_factor": 1}
