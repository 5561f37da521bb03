"""The sim engine's side of prefill/decode disaggregation, as vLLM's NixlConnector plays it.

Every sim engine plays both roles (vLLM's ``kv_role: kv_both``), by the request's
``kv_transfer_params``:

- **prefill** (``do_remote_decode: true``): the prompt is computed as usual; a reply that
  ends at its ``max_tokens`` (the proxy asks for one) keeps its KV blocks held for the
  decode engine, and its answer carries the params a decode engine needs to pull them
  (``do_remote_prefill: true``, ``remote_block_ids``, ``remote_engine_id``,
  ``remote_request_id``, ``remote_host``, ``remote_port``, ``tp_size`` and the rest vLLM
  0.32 sends). A reply that ends otherwise frees them at once and carries none, as vLLM's
  ``request_finished``. Held blocks are freed when pulled or when
  ``kv_transfer_timeout`` runs out (vLLM's ``VLLM_NIXL_ABORT_REQUEST_TIMEOUT``, 480 s).
- **decode** (``do_remote_prefill: true`` with the remote fields): the blocks are pulled
  instead of the prompt computed. NIXL's pull is a read of the prefill engine's memory
  followed by a notification that frees the blocks there; the sim does both with one HTTP
  call to the prefill engine's own port (``POST /kv_transfer/pull``), which answers after
  the blocks' transfer time (``kv_transfer_ms_per_block``) and frees them. The decode
  engine then holds the prompt as cached blocks and computes its last token only. A pull
  that fails (the prefill engine gone, the blocks expired) recomputes the prompt, as
  vLLM's ``kv_load_failure_policy: recompute``; params that lack a remote field are
  served as a plain request, as vLLM does (it logs "Got invalid KVTransferParams").

``GET /kv_transfer/stats`` shows the counts (held, pulled, expired, failed pulls), which
tests read to show that no KV is stranded.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import TYPE_CHECKING, Any

import orjson

if TYPE_CHECKING:
    from .engine import Sequence
    from .kvcache import KVCache
    from .settings import SimConfig

PULL_PATH = "/kv_transfer/pull"
STATS_PATH = "/kv_transfer/stats"

# The fields without which vLLM's decode side does not pull (its NixlConnector's check).
_REMOTE_FIELDS = ("remote_engine_id", "remote_request_id", "remote_host", "remote_port")


class _Held:
    __slots__ = ("alloc", "blocks", "block_ids", "timer")

    def __init__(self, alloc: Any, blocks: int, block_ids: list[int], timer: asyncio.TimerHandle | None) -> None:
        self.alloc = alloc
        self.blocks = blocks
        self.block_ids = block_ids
        self.timer = timer


class KVTransfer:
    """One engine's held prefill blocks and its pulls."""

    def __init__(self, cfg: SimConfig, kv: KVCache) -> None:
        self.cfg = cfg
        self.kv = kv
        self.engine_id = str(uuid.uuid4())
        self.host = cfg.host
        self.port = cfg.port
        self.held: dict[str, _Held] = {}
        self._next_block = 0
        self.pulled = 0
        self.pulled_blocks = 0
        self.expired = 0
        self.expired_blocks = 0
        self.prefills = 0  # answers that handed blocks over
        self.remote_prefills = 0  # decode requests served from pulled blocks
        self.pull_failures = 0

    def bind(self, host: str, port: int) -> None:
        """The address decode engines pull from: the port the engine listens on."""
        self.host = host
        self.port = port

    # -- the prefill side --------------------------------------------------------------
    def keep(self, rid: str, seq: Sequence) -> None:
        """A finished prefill's blocks, taken from the engine before it frees them."""
        n = seq.alloc.num_blocks
        ids = list(range(self._next_block, self._next_block + n))
        self._next_block += n
        loop = asyncio.get_running_loop()
        timer = loop.call_later(self.cfg.kv_transfer_timeout / self.cfg.time_scale, self._expire, rid)
        self.held[rid] = _Held(seq.alloc, n, ids, timer)
        seq.alloc = None

    def params_for(self, rid: str, prompt_tokens: int) -> dict | None:
        """The answer's ``kv_transfer_params``: what a decode engine needs to pull ``rid``'s
        blocks (None: none are held, the reply did not end at its max tokens)."""
        h = self.held.get(rid)
        if h is None:
            return None
        self.prefills += 1
        expiry = asyncio.get_running_loop().time() + self.cfg.kv_transfer_timeout / self.cfg.time_scale
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": h.block_ids,
            "remote_engine_id": self.engine_id,
            "remote_request_id": rid,
            "remote_host": self.host,
            "remote_port": self.port,
            "tp_size": 1,
            "transfer_mode": "pull",
            "remote_num_tokens": prompt_tokens,
            "remote_blocks_expiry_time": expiry,
            "dcp_size": 1,
            "pp_size": 1,
        }

    def _free(self, rid: str) -> _Held | None:
        h = self.held.pop(rid, None)
        if h is None:
            return None
        if h.timer is not None:
            h.timer.cancel()
        self.kv.release(h.alloc)
        return h

    def _expire(self, rid: str) -> None:
        h = self._free(rid)
        if h is not None:
            self.expired += 1
            self.expired_blocks += h.blocks

    async def serve_pull(self, body: bytes) -> tuple[int, dict]:
        """A decode engine's pull: the blocks' transfer time, then they are freed here."""
        try:
            d = orjson.loads(body)
            rid = d["remote_request_id"]
            engine_id = d["remote_engine_id"]
        except (ValueError, KeyError, TypeError):
            return 400, {"error": "a pull names remote_request_id and remote_engine_id"}
        h = self.held.get(rid) if engine_id == self.engine_id else None
        if h is None:
            return 404, {"error": f"no blocks held for {rid!r} on engine {engine_id!r}"}
        await asyncio.sleep(h.blocks * self.cfg.kv_transfer_ms_per_block / 1000.0 / self.cfg.time_scale)
        if self._free(rid) is None:  # expired during the transfer
            return 404, {"error": f"the blocks of {rid!r} expired"}
        self.pulled += 1
        self.pulled_blocks += h.blocks
        return 200, {"blocks": h.blocks}

    # -- the decode side ---------------------------------------------------------------
    async def pull(self, params: dict) -> bool:
        """Pull the blocks ``params`` name from their prefill engine; False: it failed
        (the prompt is then computed here)."""
        host, port = params["remote_host"], params["remote_port"]
        body = orjson.dumps(
            {
                "remote_request_id": params["remote_request_id"],
                "remote_engine_id": params["remote_engine_id"],
                "remote_block_ids": params.get("remote_block_ids"),
            }
        )
        writer = None
        try:
            reader, writer = await asyncio.open_connection(str(host), int(port))
            writer.write(
                b"POST %s HTTP/1.1\r\nhost: %s:%d\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
                b"connection: close\r\n\r\n%s" % (PULL_PATH.encode(), str(host).encode(), int(port), len(body), body)
            )
            await writer.drain()
            line = await reader.readline()
            ok = line.startswith(b"HTTP/1.1 200")
        except (OSError, ValueError, asyncio.IncompleteReadError):
            ok = False
        finally:
            if writer is not None:
                writer.close()
        if ok:
            self.remote_prefills += 1
        else:
            self.pull_failures += 1
        return ok

    def stats(self) -> dict:
        return {
            "engine_id": self.engine_id,
            "held_requests": len(self.held),
            "held_blocks": sum(h.blocks for h in self.held.values()),
            "prefills": self.prefills,
            "pulled": self.pulled,
            "pulled_blocks": self.pulled_blocks,
            "expired": self.expired,
            "expired_blocks": self.expired_blocks,
            "remote_prefills": self.remote_prefills,
            "pull_failures": self.pull_failures,
        }


def role_of(params: dict | None) -> str | None:
    """What a request's ``kv_transfer_params`` ask of this engine: "prefill" (compute and
    hold for a remote decode), "decode" (pull a remote prefill), or None (a plain request,
    which params lacking a remote field are too, as in vLLM)."""
    if not params:
        return None
    if params.get("do_remote_decode"):
        return "prefill"
    if params.get("do_remote_prefill") and params.get("remote_block_ids"):
        if all(params.get(k) is not None for k in _REMOTE_FIELDS):
            return "decode"
    return None
