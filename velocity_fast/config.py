"""Settings: msgspec Structs, YAML loading, precedence and validation (docs/configuration.md).

Precedence: command-line flag > VELOCITY_* environment variable > config file > default.
Every error names the key that is wrong, in one line.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import msgspec

from velocity_fast.admission.errors import AdmissionConfigError
from velocity_fast.admission.settings import AdmissionSettings, BandSettings
from velocity_fast.fleet.health import HealthSettings

__all__ = ["Settings", "EndpointConfig", "KVEventsConfig", "BandConfig", "TenantConfig", "ModelConfig", "ServerSettings",
           "ConfigError", "load_settings", "parse_endpoint_flag", "DEFAULT_BANDS"]


class ConfigError(ValueError):
    """A configuration problem, said in one line that names the key."""


class _S(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    pass


class KVEventsConfig(_S):
    """Where an engine publishes its KV cache events (vLLM's --kv-events-config), as
    addresses to connect to."""

    endpoint: str                       # tcp://host:port of the PUB socket
    replay_endpoint: str | None = None  # tcp://host:port of the ROUTER replay socket
    topic: str = ""


class EndpointConfig(_S):
    name: str
    url: str
    model: str
    api_key: str | None = None   # the engine's own --api-key, sent upstream
    kv_events: KVEventsConfig | None = None   # for precise prefix routing


class ModelConfig(_S):
    profile: str = "chat"
    prefix: str | None = None      # approximate | precise | off; None: routing.prefix
    tokenizer: str | None = None   # tokenizer.json or model folder; None: routing.tokenizer


BandConfig = BandSettings  # one definition of a band, shared with admission


class TenantConfig(_S):
    name: str
    api_key: str | None = None
    max_band: str | None = None       # the highest band this tenant may ask for
    weight: float = 1.0
    requests_per_second: float | None = None   # token-bucket rate limit (429 rate-limit)
    burst: int | None = None
    tokens_per_minute: float | None = None     # engine tokens (prompt + completion) a minute (429 rate-limit)
    sla_ms: float | None = None       # this tenant's SLA for requests that name none (None: the server's)


class ServerSettings(_S):
    """Client-facing HTTP limits of the gateway."""

    max_body_bytes: int = 16 * 1024 * 1024
    max_header_bytes: int = 64 * 1024
    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    keepalive_timeout_s: float = 75.0
    shutdown_grace_s: float = 10.0
    upstream_connect_timeout_s: float = 3.0
    # A new connection that sends no byte within this is closed without an answer (nginx's
    # client_header_timeout); None: header_timeout_s. Kept-alive connections wait
    # keepalive_timeout_s between requests.
    first_byte_timeout_s: float | None = None


DEFAULT_BANDS = AdmissionSettings().bands


class Settings(_S):
    policy: str = "dynamic"
    model_path: str | None = None
    host: str = "0.0.0.0"
    port: int = 8000
    admin_port: int = 9090
    sla_ms: float = 3000.0
    max_concurrency: int = 32
    max_model_len: int = 131072  # prompts of 256 KiB and more; vLLM engines get at most their model's own
    api_key: str | None = None
    structured_logs: bool = False
    log_level: str = "info"
    endpoints: list[EndpointConfig] = msgspec.field(default_factory=list)
    models: dict[str, ModelConfig] = msgspec.field(default_factory=dict)
    bands: list[BandConfig] = msgspec.field(default_factory=lambda: list(DEFAULT_BANDS))
    tenants: list[TenantConfig] = msgspec.field(default_factory=list)
    admission: dict[str, Any] = msgspec.field(default_factory=dict)
    routing: dict[str, Any] = msgspec.field(default_factory=dict)
    health: HealthSettings = msgspec.field(default_factory=HealthSettings)
    server: ServerSettings = msgspec.field(default_factory=ServerSettings)
    sim: dict[str, Any] = msgspec.field(default_factory=dict)
    # redis://host:port/db: tenant buckets shared by every replica (None: each replica its own)
    state_store: str | None = None

    def validate(self) -> "Settings":
        if self.policy not in ("static", "dynamic", "smart"):
            raise ConfigError(f"policy: must be static, dynamic or smart, not {self.policy!r}")
        for key in ("port", "admin_port"):
            v = getattr(self, key)
            if not 0 <= v <= 65535:
                raise ConfigError(f"{key}: {v} is not a TCP port")
        if self.sla_ms <= 0:
            raise ConfigError(f"sla_ms: must be positive, got {self.sla_ms}")
        for key in ("header_timeout_s", "body_timeout_s", "keepalive_timeout_s", "first_byte_timeout_s"):
            v = getattr(self.server, key)
            if v is not None and not v > 0:
                raise ConfigError(f"server.{key}: must be positive, got {v}")
        if self.max_concurrency < 1:
            raise ConfigError(f"max_concurrency: must be at least 1, got {self.max_concurrency}")
        try:  # bands and the admission section are admission's to judge, routing's its own
            AdmissionSettings.from_settings(self)
            from .routing.settings import RoutingSettings
            rs = RoutingSettings.from_config(self.routing, self.models)
        except (AdmissionConfigError, ValueError) as e:
            raise ConfigError(str(e)) from None
        for model in sorted({e.model for e in self.endpoints} | set(self.models)):
            if rs.prefix_for(model) == "precise" and rs.tokenizer_for(model) is None:
                raise ConfigError(f"routing.prefix: model {model!r} is precise but has no tokenizer "
                                  f"(models.{model}.tokenizer, routing.tokenizer or --tokenizer)")
        for where, path in [("routing.tokenizer", rs.tokenizer)] + [
                (f"models.{m}.tokenizer", p) for m, p in rs.tokenizers.items()]:
            if path is not None and not os.path.exists(path):
                raise ConfigError(f"{where}: no such file or folder: {path!r}")
        if self.state_store is not None:
            from .fleet.statestore import check_url
            wrong = check_url(self.state_store)
            if wrong:
                raise ConfigError(f"state_store: {wrong}")
            import importlib.util
            if importlib.util.find_spec("redis") is None:
                raise ConfigError("state_store: needs the redis package (pip install 'velocityllm[redis]')")
        names = [b.name for b in self.bands]
        seen_ep = set()
        for i, e in enumerate(self.endpoints):
            if e.name in seen_ep:
                raise ConfigError(f"endpoints[{i}].name: duplicate endpoint name {e.name!r}")
            seen_ep.add(e.name)
            if not e.url.startswith("http://"):
                raise ConfigError(f"endpoints[{i}].url: must start with http://, got {e.url!r}")
            if e.kv_events is not None:
                for key in ("endpoint", "replay_endpoint"):
                    v = getattr(e.kv_events, key)
                    if v is not None and not v.startswith(("tcp://", "ipc://")):
                        raise ConfigError(f"endpoints[{i}].kv_events.{key}: must be a tcp:// or ipc:// "
                                          f"address to connect to, got {v!r}")
        keys = set()
        for i, t in enumerate(self.tenants):
            if t.max_band is not None and t.max_band not in names:
                raise ConfigError(f"tenants[{i}].max_band: unknown band {t.max_band!r} (bands: {names})")
            if t.sla_ms is not None and not t.sla_ms > 0:
                raise ConfigError(f"tenants[{i}].sla_ms: must be positive, got {t.sla_ms}")
            if not 0 < t.weight < float("inf"):
                raise ConfigError(f"tenants[{i}].weight: must be a positive number, got {t.weight}")
            for key in ("requests_per_second", "burst", "tokens_per_minute"):
                v = getattr(t, key)
                if v is not None and not 0 < v < float("inf"):
                    raise ConfigError(f"tenants[{i}].{key}: must be a positive, finite number, got {v}")
            if t.api_key:
                if t.api_key in keys:
                    raise ConfigError(f"tenants[{i}].api_key: the same key is given to two tenants")
                keys.add(t.api_key)
        return self


def parse_endpoint_flag(value: str) -> EndpointConfig:
    """--endpoint NAME=URL=MODEL (the URL may hold '=' only in its query, which we do not use)."""
    parts = value.split("=")
    if len(parts) != 3 or not all(parts):
        raise ConfigError(f"--endpoint: expected NAME=URL=MODEL, got {value!r}")
    return EndpointConfig(name=parts[0], url=parts[1], model=parts[2])


def _msgspec_error(err: Exception, source: str) -> ConfigError:
    text = str(err)
    # msgspec says e.g. "Object contains unknown field `foo` - at `$.bands[0]`": keep it, name the source.
    return ConfigError(f"{source}: {text}")


def _env_overrides(env: dict[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    scalar = {f for f in Settings.__struct_fields__
              if f not in ("endpoints", "models", "bands", "tenants", "admission", "routing", "health",
                           "server", "sim")}
    for key, value in env.items():
        if not key.startswith("VELOCITY_"):
            continue
        name = key[len("VELOCITY_"):].lower()
        if name in scalar:
            out[name] = value
        elif name == "endpoints":
            out[name] = [msgspec.to_builtins(parse_endpoint_flag(v.strip())) for v in value.split(",") if v.strip()]
    return out


def load_settings(config_file: str | None = None, flags: dict[str, Any] | None = None,
                  env: dict[str, str] | None = None) -> Settings:
    """Merge default < file < environment < flags, then validate. Raises ConfigError."""
    import yaml

    env = dict(os.environ if env is None else env)
    config_file = config_file or env.get("VELOCITY_CONFIG")
    data: dict[str, Any] = {}
    source = "defaults"
    if config_file:
        source = str(config_file)
        try:
            text = Path(config_file).read_text()
        except OSError as e:
            raise ConfigError(f"{config_file}: cannot read: {e.strerror or e}") from None
        try:
            loaded = yaml.safe_load(text)
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f" at line {mark.line + 1}" if mark else ""
            raise ConfigError(f"{config_file}: invalid YAML{where}: {getattr(e, 'problem', e)}") from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"{config_file}: the top level must be a mapping of keys")
        data.update(loaded)
    env_part = _env_overrides(env)
    data.update(env_part)
    for key, value in (flags or {}).items():
        if value is None:
            continue
        if key == "endpoints":
            data["endpoints"] = [msgspec.to_builtins(e) for e in value]
        elif key == "routing":  # a flag sets its key of the section, the file keeps the rest
            data["routing"] = {**(data.get("routing") or {}), **value}
        else:
            data[key] = value
    try:
        settings = msgspec.convert(data, Settings, strict=False)
    except msgspec.ValidationError as e:
        where = source + (" (with VELOCITY_* environment)" if env_part else "")
        raise _msgspec_error(e, where) from None
    try:
        return settings.validate()
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None
