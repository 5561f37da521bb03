"""Routing settings (the `routing:` section of the config, plus the per-model profiles).

Defaults live here and nowhere else. Build them from the config file with
``RoutingSettings.from_config(settings.routing, settings.models)``; an unknown key, a
wrong type or an unknown profile name is a ValueError that names the key.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Mapping

import msgspec

from velocity_fast.routing.profiles import PROFILES

__all__ = [
    "PROFILES",
    "PROFILE_HEADER",
    "SESSION_HEADER",
    "PREFIX_MODES",
    "ProfileName",
    "PrefixMode",
    "RoutingSettings",
]

# The request headers that pick a routing profile and name a session.
PROFILE_HEADER = "x-velocity-profile"
SESSION_HEADER = "x-session-id"

# The routing profiles are those registered in profiles/__init__.py (one line each).
ProfileName = Literal[PROFILES]  # type: ignore[valid-type]
# How the chat profile knows what an engine's prefix cache holds (docs/kv-events.md).
PREFIX_MODES = ("approximate", "precise", "off")
PrefixMode = Literal["approximate", "precise", "off"]

# The range of every number (docs/configuration.md, "Ranges"), checked by msgspec where
# the section is read. Loads and gaps are counts of requests: a million is past any engine.
# Up to 1e12: a guard or weight set far past any load (1e9) is how it is turned off, as
# for pure prefix affinity (bench/prefix.py's comparison).
_Load = Annotated[float, msgspec.Meta(ge=0, le=1e12)]
_Weight = Annotated[float, msgspec.Meta(ge=0, le=1e12)]


class RoutingSettings(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """How the router filters, scores and picks endpoints."""

    # Prefix blocks: 64 bytes is about 16 tokens, one vLLM KV block. A multiple of 32.
    block_bytes: Annotated[int, msgspec.Meta(ge=32, le=65536, multiple_of=32)] = 64
    # Blocks remembered per endpoint while the engine's num_gpu_blocks is unknown.
    index_capacity: Annotated[int, msgspec.Meta(ge=0, le=1_000_000_000)] = 16384
    # Converts the engine's KV blocks (block_size tokens each) into index blocks.
    bytes_per_token: Annotated[float, msgspec.Meta(gt=0, le=1024)] = 4.0
    # Hot-spot guard: an affinity pick whose engine queues this many requests or more
    # (its own waiting gauge: demand past what it runs at once) spills to the best of the
    # engines that do not, which holds the prefix from then on too (docs/design.md).
    hotspot_waiting: _Load = 2.0
    # The same guard where an engine's gauges are not fresh: a load (engine waiting +
    # gateway in flight) more than this above the least loaded endpoint. Also the load
    # scale of load_weight.
    hotspot_gap: _Load = 8.0
    # Within the gap, how much load costs against affinity: a load gap of a full
    # hotspot_gap costs this fraction of a perfect prefix match.
    load_weight: _Weight = 0.25
    # Session affinity's load guard, in the same units as hotspot_gap.
    session_gap: _Load = 8.0
    # Saturated endpoints are filtered out (fail open when that would remove all):
    # engine queue at or past this many waiting, or KV usage at or past this fraction.
    saturation_waiting: Annotated[float, msgspec.Meta(gt=0, le=1e12)] = 5.0
    saturation_kv: Annotated[float, msgspec.Meta(gt=0, le=1)] = 0.8
    # An engine without room for the request (at its concurrency limit, past the band's
    # share of it, or its learned batch all in flight) is passed over while another has
    # room. False: pure affinity, for comparison: the engine the profile scores best takes
    # the request anyway and queues it (docs/configuration.md).
    spill: bool = True
    # Engine gauges older than this are ignored (the gateway's own counts stand in).
    metrics_stale_s: Annotated[float, msgspec.Meta(gt=0, le=86_400)] = 2.0
    default_profile: ProfileName = "chat"
    # Per model (served name) profile; the x-velocity-profile header overrides it.
    profiles: dict[str, ProfileName] = msgspec.field(default_factory=dict)
    # Seed of the tie-breaking random generator; None draws one from the OS.
    seed: int | None = None
    # Prefix affinity of the chat profile: approximate (where this gateway sent prompts),
    # precise (the engines' own KV events, docs/kv-events.md) or off (load alone).
    prefix: PrefixMode = "approximate"
    # Per model (served name) prefix mode; models.<name>.prefix fills it.
    prefix_modes: dict[str, PrefixMode] = msgspec.field(default_factory=dict)
    # The tokenizer.json (or a model folder holding one) of precise pools, and per model.
    tokenizer: str | None = None
    tokenizers: dict[str, str] = msgspec.field(default_factory=dict)
    # Prompt byte blocks whose token blocks precise routing keeps (the token cache; whole
    # prompts and runs of leading messages: a sixteenth of this each).
    token_cache_entries: Annotated[int, msgspec.Meta(ge=1, le=10_000_000)] = 16384
    # Precise routing: an exact engine's free cache (1 - the blocks its events say it
    # holds / its num_gpu_blocks) times this is added to its prefix score, so that an
    # emptied engine (a restart) takes back prompts that full caches only partly hold.
    free_cache_weight: _Weight = 1.0
    # Precise routing: a prompt new to the token cache waits at most this long for the
    # tokenizer thread before its pick (typically a millisecond or two); 0 picks it at once,
    # approximately. Not while more than a few prompts wait in the thread's queue.
    precise_token_wait_ms: Annotated[float, msgspec.Meta(ge=0, le=1000)] = 25.0

    @classmethod
    def from_config(
        cls, routing: Mapping[str, Any] | None = None, models: Mapping[str, Any] | None = None
    ) -> "RoutingSettings":
        """Build from the config's `routing:` mapping and its `models: {name: {profile}}`.

        A model entry may be a mapping or an object with a ``profile`` attribute.
        Raises ValueError naming the offending key.
        """
        data = dict(routing or {})

        def mapping(key: str) -> dict:
            value = data.pop(key, None)
            if value is not None and not isinstance(value, Mapping):
                raise ValueError(f"routing.{key}: expected a mapping of model name to value, got {value!r}")
            return dict(value or {})

        profiles, modes, tokenizers = mapping("profiles"), mapping("prefix_modes"), mapping("tokenizers")
        for name, entry in (models or {}).items():

            def get(key: str) -> Any:
                return entry.get(key) if isinstance(entry, Mapping) else getattr(entry, key, None)

            profile = get("profile")
            if profile is not None:
                if profile not in PROFILES:
                    raise ValueError(
                        f"models.{name}.profile: unknown profile {profile!r} (one of {', '.join(PROFILES)})"
                    )
                profiles[name] = profile
            mode = get("prefix")
            if mode is not None:
                if mode not in PREFIX_MODES:
                    raise ValueError(
                        f"models.{name}.prefix: unknown prefix mode {mode!r} (one of {', '.join(PREFIX_MODES)})"
                    )
                modes[name] = mode
            tok = get("tokenizer")
            if tok is not None:
                tokenizers[name] = tok
        data["profiles"] = profiles
        data["prefix_modes"] = modes
        data["tokenizers"] = tokenizers
        try:
            return msgspec.convert(data, cls)
        except msgspec.ValidationError as e:
            raise ValueError(f"routing: {e}") from None

    def profile_for(self, model: str) -> str:
        """The configured profile of a model (the default when the model has none)."""
        return self.profiles.get(model, self.default_profile)

    def prefix_for(self, model: str) -> str:
        """The prefix mode of a model (the default when the model has none)."""
        return self.prefix_modes.get(model, self.prefix)

    def tokenizer_for(self, model: str) -> str | None:
        """The tokenizer of a model's pool (the default when the model has none)."""
        return self.tokenizers.get(model, self.tokenizer)

    def precise_models(self) -> bool:
        """Whether any pool may be precise (the default or one model)."""
        return self.prefix == "precise" or "precise" in self.prefix_modes.values()
