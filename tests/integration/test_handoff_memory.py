"""A hand-off deleted from a shared Redis tier leaves the server's chunk memory (what miss
reasons are explained from) too: an in-process engine on a real Redis, driven by protocol
frames."""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any

from kvtier import protocol as p
from kvtier.config import ServerConfig
from kvtier.keys import compose
from kvtier.names import named_chunk_keys
from kvtier.periodic import PeriodicThreadRegistry
from kvtier.server.app import build_engine
from kvtier.server.observe.chunkmemory import ChunkMemory

CLIENT = b"producer"


def call(engine: Any, msg: Any, payloads: list[bytes] | None = None) -> Any:
    return p.decode_reply(engine.call(CLIENT, p.encode(msg), payloads)[0])


def test_a_handoff_deleted_from_redis_leaves_the_chunk_memory(
    tmp_path: Path, redis_url: str, redis_prefix: str
) -> None:
    config = ServerConfig(
        address=[f"ipc://{tmp_path}/kvtier.sock"],
        l1_size=1 << 20,
        l2=[f"{redis_url}?prefix={redis_prefix}"],
        chunk_size=16,
        arena_name=f"kvtier-handoff-test-{os.getpid()}-{uuid.uuid4().hex[:8]}",
        prefault=False,
    )
    memory = ChunkMemory(64)
    engine = build_engine(
        config, registry=PeriodicThreadRegistry(), start_threads=False, memory=memory
    )
    try:
        hello = p.Hello(p.PROTOCOL_VERSION, "c1", host_id=p.local_host_id(), pid=os.getpid())
        assert isinstance(call(engine, hello), p.HelloReply)
        assert isinstance(call(engine, p.Register("m", 1, 0, [64], "uint8")), p.Ok)
        names = [b"h/0", b"h/1"]
        store = p.StoreKeysInline(names, "m", 1, 0, [64], "uint8", 2, request_id="h", handoff=True)
        assert isinstance(call(engine, store, [bytes([i]) * 64 for i in range(2)]), p.StoreReply)
        assert engine.tiers.flush(timeout=10), "the L2 writer never wrote the hand-off"
        # the keys in the (default) tenant's namespace, as the server names them
        keys = named_chunk_keys(
            names, model=compose("", "m"), cache_salt=compose("", ""), world_size=1
        )
        tier = engine.tiers.tiers[0].name
        assert [w.held_by for w in memory.whereabouts(keys)] == [tier, tier]
        assert isinstance(call(engine, p.EndHandoff("h", names, "m")), p.Ok)
        seen = memory.whereabouts(keys)
        assert [(w.held_by, w.left) for w in seen] == [("", tier)] * 2, seen
    finally:
        engine.close()
