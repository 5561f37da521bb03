"""Settings: msgspec Structs, YAML loading, precedence and validation (docs/configuration.md).

Precedence: command-line flag > VELOCITY_* environment variable > config file > default.
Every error is one line, ``<source>: <key>: <why>``: the source is the flag
(``--sla-ms``), the environment variable (``VELOCITY_SLA_MS``) or the file that gave the
value, the key its full name (``admission.tick_ms``, ``tenants[0].burst``).

Every number has a range, declared beside its default as msgspec ``Meta`` constraints
(docs/configuration.md, "Ranges"), so that it is checked wherever settings are read: at
start and on every reload.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec

from velocity_fast.admission.errors import AdmissionConfigError
from velocity_fast.admission.settings import AdmissionSettings, BandSettings
from velocity_fast.fleet.health import HealthSettings

__all__ = [
    "Settings",
    "EndpointConfig",
    "KVEventsConfig",
    "BandConfig",
    "TenantConfig",
    "ModelConfig",
    "ServerSettings",
    "TracingSettings",
    "ConfigError",
    "load_settings",
    "parse_endpoint_flag",
    "DEFAULT_BANDS",
    "explain",
    "key_range",
    "key_type",
]


class ConfigError(ValueError):
    """A configuration problem, said in one line that names the key. ``raw``: msgspec's own
    text, where it came from there (so that the value can be looked up where it was given)."""

    def __init__(self, message: str, raw: str | None = None) -> None:
        super().__init__(message)
        self.raw = raw


class _S(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    pass


# Ranges (docs/configuration.md, "Ranges"). Times stop at a day: a longer wait, timeout or
# SLA is a mistake, and a bounded one keeps every derived figure (a Retry-After, a timer)
# finite.
_Port = Annotated[int, msgspec.Meta(ge=0, le=65535)]  # 0: a free port
_SlaMs = Annotated[float, msgspec.Meta(gt=0, le=86_400_000)]
_Seconds = Annotated[float, msgspec.Meta(ge=0.001, le=86_400)]  # a timeout: at least 1 ms
_Weight = Annotated[float, msgspec.Meta(gt=0, le=1_000_000)]


class KVEventsConfig(_S):
    """Where an engine publishes its KV cache events (vLLM's --kv-events-config), as
    addresses to connect to."""

    endpoint: str  # tcp://host:port of the PUB socket
    replay_endpoint: str | None = None  # tcp://host:port of the ROUTER replay socket
    topic: str = ""


class EndpointConfig(_S):
    name: str
    url: str
    model: str
    api_key: str | None = None  # the engine's own --api-key, sent upstream
    kv_events: KVEventsConfig | None = None  # for precise prefix routing
    # What the engine does in prefill/decode disaggregation (docs/pd.md): prefill, decode,
    # or both (a colocated engine, the default).
    role: Literal["prefill", "decode", "both"] = "both"


class ModelConfig(_S):
    profile: str = "chat"
    prefix: str | None = None  # approximate | precise | off; None: routing.prefix
    tokenizer: str | None = None  # tokenizer.json or model folder; None: routing.tokenizer


BandConfig = BandSettings  # one definition of a band, shared with admission


class TenantConfig(_S):
    name: str
    api_key: str | None = None
    max_band: str | None = None  # the highest band this tenant may ask for
    weight: _Weight = 1.0
    # Token-bucket rate limit (429 rate-limit). Positive: a rate of 0 would never refill
    # the bucket, and a burst below 1 never holds the one token a request takes.
    requests_per_second: Annotated[float, msgspec.Meta(gt=0, le=1_000_000)] | None = None
    burst: Annotated[int, msgspec.Meta(ge=1, le=1_000_000_000)] | None = None
    # Engine tokens (prompt + completion) a minute (429 rate-limit); positive, as the rate.
    tokens_per_minute: Annotated[float, msgspec.Meta(gt=0, le=1e12)] | None = None
    sla_ms: _SlaMs | None = None  # this tenant's SLA for requests that name none (None: the server's)


class ServerSettings(_S):
    """Client-facing HTTP limits of the gateway."""

    max_body_bytes: Annotated[int, msgspec.Meta(ge=1, le=2**31 - 1)] = 16 * 1024 * 1024
    max_header_bytes: Annotated[int, msgspec.Meta(ge=1024, le=16 * 1024 * 1024)] = 64 * 1024
    header_timeout_s: _Seconds = 10.0
    body_timeout_s: _Seconds = 60.0
    keepalive_timeout_s: _Seconds = 75.0
    shutdown_grace_s: Annotated[float, msgspec.Meta(ge=0, le=86_400)] = 10.0
    upstream_connect_timeout_s: _Seconds = 3.0
    # A new connection that sends no byte within this is closed without an answer (nginx's
    # client_header_timeout); None: header_timeout_s. Kept-alive connections wait
    # keepalive_timeout_s between requests.
    first_byte_timeout_s: _Seconds | None = None


class PdSettings(_S):
    """Prefill/decode disaggregation (docs/pd.md): when a request of a pool with prefill
    and decode endpoints takes two legs, and how long its prefill leg may take."""

    # The prompt's part not cached on the chosen decode engine, in tokens, from which a
    # request is disaggregated; below it runs on the decode engine alone (docs/pd.md, "The
    # decider", for the measurement behind 256).
    min_uncached_tokens: Annotated[int, msgspec.Meta(ge=0, le=16_777_216)] = 256
    # The prefill leg's answer must come within this; else it is retried once elsewhere.
    prefill_timeout_s: _Seconds = 60.0
    # Conditional disaggregation: the uncached prompt tokens of the prefill legs the
    # gateway keeps in flight on one prefill engine. A request whose leg would take every
    # prefill engine past it runs on its decode engine alone (counted prefill_busy), as
    # Dynamo does past its prefill queue's bound; a lone leg always goes. 0: no bound.
    max_prefill_tokens_in_flight: Annotated[int, msgspec.Meta(ge=0, le=16_777_216)] = 16384


class TracingSettings(_S):
    """OpenTelemetry traces of the proxied requests (docs/tracing.md); off at ratio 0."""

    # The collector's OTLP/HTTP address: a URL with no path (http://host:4318) gets
    # /v1/traces, one with a path is used as it is. None: OTEL_EXPORTER_OTLP_TRACES_ENDPOINT,
    # else OTEL_EXPORTER_OTLP_ENDPOINT (load_settings reads them).
    otlp_endpoint: str | None = None
    # The share of requests that start a trace; a request that comes with a traceparent
    # follows its caller's sampled flag (parent-based, as OpenTelemetry's parentbased_traceidratio). 0: off.
    sample_ratio: Annotated[float, msgspec.Meta(ge=0, le=1)] = 0.0
    # Finished spans waiting for the exporter: past it they are dropped, not kept (a
    # collector that is down cannot grow the gateway's memory).
    max_queue_size: Annotated[int, msgspec.Meta(ge=1, le=1_000_000)] = 2048


DEFAULT_BANDS = AdmissionSettings().bands


class Settings(_S):
    policy: str = "dynamic"
    model_path: str | None = None
    # chargeVelocity's engines: vllm, sim or auto (vLLM on GPUs with a model, else sim).
    engine: Literal["auto", "vllm", "sim"] = "auto"
    vllm_python: str | None = None
    host: str = "0.0.0.0"
    port: _Port = 8000
    admin_port: _Port = 9090
    sla_ms: _SlaMs = 3000.0
    max_concurrency: Annotated[int, msgspec.Meta(ge=1, le=100_000)] = 32
    # Prompts of 256 KiB and more; vLLM engines get at most their model's own.
    max_model_len: Annotated[int, msgspec.Meta(ge=1, le=16_777_216)] = 131072
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
    pd: PdSettings = msgspec.field(default_factory=PdSettings)
    sim: dict[str, Any] = msgspec.field(default_factory=dict)
    # redis://host:port/db: tenant buckets shared by every replica (None: each replica its own)
    state_store: str | None = None
    # Gateway processes on the client port under a supervisor (gateway/workers.py); auto:
    # one per core. 1: the one process of old, no supervisor.
    workers: Annotated[int, msgspec.Meta(ge=1, le=1024)] | Literal["auto"] = 1
    tracing: TracingSettings = msgspec.field(default_factory=TracingSettings)

    def validate(self) -> "Settings":
        """Check ranges and the relations between values; raise ConfigError naming the key."""
        try:  # the ranges, also of an instance built directly rather than converted
            msgspec.convert(msgspec.to_builtins(self), Settings)
        except msgspec.ValidationError as e:
            raise ConfigError(explain(str(e)), str(e)) from None
        if self.policy not in ("static", "dynamic", "smart"):
            raise ConfigError(f"policy: must be static, dynamic or smart, not {self.policy!r}")
        try:  # bands and the admission section are admission's to judge, routing's its own
            adm = AdmissionSettings.from_settings(self)
            from .routing.settings import RoutingSettings

            # As the gateway builds it (gateway/assemble.py): saturation defaults from admission.
            routing = {"saturation_waiting": adm.queue_threshold, "saturation_kv": adm.kv_threshold, **self.routing}
            rs = RoutingSettings.from_config(routing, self.models)
        except (AdmissionConfigError, ValueError) as e:
            raise ConfigError(explain(str(e)), str(e)) from None
        # A precise pool that could make no precise pick is refused, saying why: precise
        # routing needs the prompt's tokens, the chat profile (the one that reads prefixes)
        # and an endpoint whose engine publishes its KV events.
        served = {e.model for e in self.endpoints}
        for model in sorted(served | set(self.models)):
            if rs.prefix_for(model) != "precise":
                continue
            where = f"models.{model}.prefix" if model in rs.prefix_modes else "routing.prefix"
            if rs.tokenizer_for(model) is None:
                raise ConfigError(
                    f"{where}: model {model!r} is precise but has no tokenizer "
                    f"(models.{model}.tokenizer, routing.tokenizer or --tokenizer)"
                )
            if rs.profile_for(model) != "chat":
                raise ConfigError(
                    f"{where}: model {model!r} is precise but routes with the "
                    f"{rs.profile_for(model)!r} profile, which reads no prefix (precise "
                    f"routing is the chat profile's: models.{model}.profile or "
                    f"routing.default_profile chat)"
                )
            if model in served and not any(e.kv_events is not None for e in self.endpoints if e.model == model):
                raise ConfigError(
                    f"{where}: model {model!r} is precise but none of its endpoints publishes "
                    f"KV events (give endpoints[].kv_events in the config file; "
                    f"chargeVelocity sets them up for the engines it starts)"
                )
        for where, path in [("routing.tokenizer", rs.tokenizer)] + [
            (f"models.{m}.tokenizer", p) for m, p in rs.tokenizers.items()
        ]:
            if path is not None and not os.path.exists(path):
                raise ConfigError(f"{where}: no such file or folder: {path!r}")
        if self.state_store is not None:
            from .state.store import check_url

            wrong = check_url(self.state_store)
            if wrong:
                raise ConfigError(f"state_store: {wrong}")
            import importlib.util

            if importlib.util.find_spec("redis") is None:
                raise ConfigError("state_store: needs the redis package (pip install 'velocityllm[redis]')")
        if self.tracing.sample_ratio > 0:
            wrong = _tracing_problem(self.tracing)
            if wrong:
                raise ConfigError(wrong)
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
                        raise ConfigError(
                            f"endpoints[{i}].kv_events.{key}: must be a tcp:// or ipc:// "
                            f"address to connect to, got {v!r}"
                        )
        _check_roles(self.endpoints)
        keys = set()
        for i, t in enumerate(self.tenants):
            if t.max_band is not None and t.max_band not in names:
                raise ConfigError(f"tenants[{i}].max_band: unknown band {t.max_band!r} (bands: {names})")
            if t.api_key:
                if t.api_key in keys:
                    raise ConfigError(f"tenants[{i}].api_key: the same key is given to two tenants")
                keys.add(t.api_key)
        return self


def _check_roles(endpoints: list[EndpointConfig]) -> None:
    """A pool with a role that cannot be served is refused at start (and at a reload):
    prefill endpoints need an engine that decodes, decode endpoints one that prefills."""
    roles: dict[str, set[str]] = {}
    for e in endpoints:
        roles.setdefault(e.model, set()).add(e.role)
    for model, have in sorted(roles.items()):
        i = next(i for i, e in enumerate(endpoints) if e.model == model and e.role != "both") if have != {"both"} else 0
        if "prefill" in have and not have & {"decode", "both"}:
            raise ConfigError(
                f"endpoints[{i}].role: model {model!r} has prefill endpoints but none that decodes: a "
                f"prefilled request's KV blocks need a decode engine to pull them (give one endpoint "
                f"role decode or both)"
            )
        if "decode" in have and not have & {"prefill", "both"}:
            raise ConfigError(
                f"endpoints[{i}].role: model {model!r} has decode endpoints but none that prefills: "
                f"a decode engine serves only requests whose prompt another engine computed (give one "
                f"endpoint role prefill or both)"
            )


def _tracing_problem(t: TracingSettings) -> str | None:
    """Why tracing that is on cannot start (its packages, its collector), or None."""
    import importlib.util

    try:
        found = all(
            importlib.util.find_spec(m) is not None
            for m in ("opentelemetry.sdk.trace", "opentelemetry.exporter.otlp.proto.http.trace_exporter")
        )
    except (ImportError, ValueError):  # a parent package that cannot be imported
        found = False
    if not found:
        return (
            "tracing.sample_ratio: tracing needs the OpenTelemetry SDK and OTLP exporter "
            "(pip install 'velocityllm[otel]')"
        )
    url = t.otlp_endpoint
    if not url:
        return (
            "tracing.sample_ratio: tracing is on but has no collector (tracing.otlp_endpoint, "
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or OTEL_EXPORTER_OTLP_ENDPOINT)"
        )
    if not url.startswith(("http://", "https://")):
        return f"tracing.otlp_endpoint: must be an http:// or https:// URL (OTLP/HTTP), got {url!r}"
    return None


def traces_url(endpoint: str) -> str:
    """Where the OTLP/HTTP exporter posts: ``endpoint`` with /v1/traces when it names no path."""
    rest = endpoint.split("://", 1)[-1]
    return endpoint if rest.strip("/").count("/") else endpoint.rstrip("/") + "/v1/traces"


def parse_endpoint_flag(value: str, source: str = "--endpoint") -> EndpointConfig:
    """--endpoint NAME=URL=MODEL (the URL may hold '=' only in its query, which we do not use)."""
    parts = value.split("=")
    if len(parts) != 3 or not all(parts):
        raise ConfigError(f"{source}: endpoints: expected NAME=URL=MODEL, got {value!r}")
    return EndpointConfig(name=parts[0], url=parts[1], model=parts[2])


# -- errors: msgspec's text in the project's form -----------------------------------------------

# msgspec says "<why> - at `$.<path>`"; a section adds its name in front ("admission: ...").
_SECTION = re.compile(r"^(?P<section>[a-z_]+): (?P<rest>[A-Z].*)$")
_UNKNOWN = re.compile(r"^Object contains unknown field `([^`]*)`$")
_MISSING = re.compile(r"^Object missing required field `([^`]*)`$")
_TYPE = re.compile(r"^Expected `([^`]*)`, got `([^`]*)`$")
_BOUND = re.compile(r"^Expected `(int|float)` (?:>|>=|<|<=|that's a multiple of) ")
_ENUM = re.compile(r"^Invalid enum value ")


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e15 else repr(x)


def _range_text(t: Any) -> str | None:
    """A number type's range: 'integer in [1, 1000]', 'number in (0, 86400000]',
    'any integer'; a number or words ('integer in [1, 1024] or auto'); None for other types."""
    if isinstance(t, msgspec.inspect.UnionType):
        nums = [m for m in t.types if isinstance(m, (msgspec.inspect.IntType, msgspec.inspect.FloatType))]
        words = [str(v) for m in t.types if isinstance(m, msgspec.inspect.LiteralType) for v in m.values]
        if (
            len(nums) == 1
            and words
            and len(nums) + sum(isinstance(m, msgspec.inspect.LiteralType) for m in t.types) == len(t.types)
        ):
            return f"{_range_text(nums[0])} or {', '.join(words)}"
        return None
    if not isinstance(t, (msgspec.inspect.IntType, msgspec.inspect.FloatType)):
        return None
    kind = "integer" if isinstance(t, msgspec.inspect.IntType) else "number"
    if t.ge is None and t.gt is None and t.le is None and t.lt is None:
        return f"any {kind}"
    lo = f"[{_num(t.ge)}" if t.ge is not None else f"({_num(t.gt)}" if t.gt is not None else "(-inf"
    hi = f"{_num(t.le)}]" if t.le is not None else f"{_num(t.lt)})" if t.lt is not None else "inf)"
    text = f"{kind} in {lo}, {hi}"
    if t.multiple_of is not None:
        text += f", a multiple of {_num(t.multiple_of)}"
    return text


def _key_parts(key: str) -> list[str]:
    return re.findall(r"\[[^\]]*\]|[^.\[\]]+", key)


def key_type(key: str) -> Any:
    """The msgspec.inspect type of a full key ('tenants[0].burst', 'admission.tick_ms'), or None."""
    from .routing.settings import RoutingSettings

    sections = {"admission": AdmissionSettings, "routing": RoutingSettings}
    t: Any = msgspec.inspect.type_info(Settings)
    for i, part in enumerate(_key_parts(key)):
        if isinstance(t, msgspec.inspect.UnionType):
            rest = [m for m in t.types if not isinstance(m, msgspec.inspect.NoneType)]
            t = rest[0] if len(rest) == 1 else None
        if i == 0 and part in sections:
            t = msgspec.inspect.type_info(sections[part])
        elif part.startswith("["):
            t = getattr(t, "item_type", None) or getattr(t, "value_type", None)
        elif isinstance(t, msgspec.inspect.StructType):
            t = next((f.type for f in t.fields if f.name == part), None)
        elif isinstance(t, msgspec.inspect.DictType):
            t = t.value_type
        else:
            return None
        if t is None:
            return None
    if isinstance(t, msgspec.inspect.UnionType):
        rest = [m for m in t.types if not isinstance(m, msgspec.inspect.NoneType)]
        t = rest[0] if len(rest) == 1 else t
    return t


def key_range(key: str) -> str | None:
    """The documented range of a numeric key, as docs/configuration.md writes it."""
    return _range_text(key_type(key))


_MISSING_VALUE = object()


def _lookup(data: Any, key: str) -> Any:
    for part in _key_parts(key):
        try:
            data = data[int(part[1:-1])] if part.startswith("[") else data[part]
        except (KeyError, IndexError, TypeError, ValueError):
            return _MISSING_VALUE
    return data


def _join(key: str, name: str) -> str:
    """``key.name``; a name that is no plain word (a key typed by mistake) as ``key["..."]``."""
    if re.fullmatch(r"\w+", name):
        return f"{key}.{name}" if key else name
    return f"{key}[{json.dumps(name)}]"


def explain(text: str, data: Any = _MISSING_VALUE) -> str:
    """A validation message in the form ``<key>: <why>``: msgspec's ("Expected `int` >= 1 -
    at `$.tenants[0].burst`", after a section's name or not) rewritten with the full key,
    the key's range and the value given (looked up in ``data``, the merged settings);
    a message already in that form is returned as it is."""
    section, why = None, text
    if (m := _SECTION.match(text)) is not None:
        section, why = m.group("section"), m.group("rest")
    path = ""
    if why.endswith("`") and " - at `$" in why:
        why, _, path = why[:-1].rpartition(" - at `$")
    elif not (_UNKNOWN.match(why) or _MISSING.match(why) or _TYPE.match(why)):
        return text  # already "<key>: <why>"
    key = ".".join(p for p in (section, path.lstrip(".")) if p).replace(".[", "[").replace("[...]", ".<name>")
    if (u := _UNKNOWN.match(why)) is not None:
        return f"{_join(key, u.group(1))}: unknown key"
    if (u := _MISSING.match(why)) is not None:
        return f"{_join(key, u.group(1))}: required, missing"
    value = _lookup(data, key) if data is not _MISSING_VALUE else _MISSING_VALUE
    got = "" if value is _MISSING_VALUE else f", got {value!r}"
    rng = key_range(key)
    if rng is not None and (_BOUND.match(why) or (" or " in rng and (_ENUM.match(why) or _TYPE.match(why)))):
        return f"{key}: must be {'an' if rng.startswith('integer') else 'a'} {rng}{got}"
    if (u := _TYPE.match(why)) is not None:
        return f"{key}: expected {u.group(1)}{got or ', got ' + u.group(2)}"
    return f"{key}: {why.replace('`', '')}{got}"


def _env_overrides(env: dict[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    scalar = {
        f
        for f in Settings.__struct_fields__
        if f
        not in (
            "endpoints",
            "models",
            "bands",
            "tenants",
            "admission",
            "routing",
            "health",
            "server",
            "sim",
            "tracing",
            "pd",
        )
    }
    for key, value in env.items():
        if not key.startswith("VELOCITY_"):
            continue
        name = key[len("VELOCITY_") :].lower()
        if name in scalar:
            out[name] = value
        elif name == "endpoints":
            out[name] = [
                msgspec.to_builtins(parse_endpoint_flag(v.strip(), key)) for v in value.split(",") if v.strip()
            ]
    return out


def _flag_name(key: str) -> str:
    return {"endpoints": "--endpoint"}.get(key, "--" + key.replace("_", "-"))


def _source_of(key: str, origin: dict[str, str], fallback: str) -> str:
    """The flag, variable or file that gave ``key`` (its own entry, else its section's)."""
    parts = _key_parts(key)
    for n in range(len(parts), 0, -1):
        name = ".".join(parts[:n]).replace(".[", "[")
        if name in origin:
            return origin[name]
    return fallback


def load_settings(
    config_file: str | None = None, flags: dict[str, Any] | None = None, env: dict[str, str] | None = None
) -> Settings:
    """Merge default < file < environment < flags, then validate. Raises ConfigError,
    whose one line is ``<source>: <key>: <why>``."""
    import yaml

    env = dict(os.environ if env is None else env)
    config_file = config_file or env.get("VELOCITY_CONFIG")
    data: dict[str, Any] = {}
    origin: dict[str, str] = {}  # key -> where its value came from
    fallback = "defaults"
    if config_file:
        fallback = str(config_file)
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
        origin.update({str(k): str(config_file) for k in loaded})
    env_part = _env_overrides(env)
    data.update(env_part)
    origin.update({k: f"VELOCITY_{k.upper()}" for k in env_part})
    for key, value in (flags or {}).items():
        if value is None:
            continue
        if key == "endpoints":
            data["endpoints"] = [msgspec.to_builtins(e) for e in value]
        elif key == "routing":  # a flag sets its key of the section, the file keeps the rest
            data["routing"] = {**(data.get("routing") or {}), **value}
            origin.update({f"routing.{k}": _flag_name(k) for k in value})
            continue
        else:
            data[key] = value
        origin[key] = _flag_name(key)

    # OpenTelemetry's own variables, for a collector the file does not name (the traces
    # one is a whole URL; the other a base, to which /v1/traces is added).
    tracing = data.get("tracing")
    if (tracing is None or isinstance(tracing, dict)) and not (tracing or {}).get("otlp_endpoint"):
        for var in ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT"):
            url = env.get(var, "").strip()
            if url:
                if var == "OTEL_EXPORTER_OTLP_ENDPOINT":
                    url = url.rstrip("/") + "/v1/traces"
                data["tracing"] = {**(tracing or {}), "otlp_endpoint": url}
                origin["tracing.otlp_endpoint"] = var
                break

    def error(text: str) -> ConfigError:
        why = explain(text, data)
        key = why.split(":", 1)[0]
        return ConfigError(f"{_source_of(key, origin, fallback)}: {why}")

    try:
        settings = msgspec.convert(data, Settings, strict=False)
    except msgspec.ValidationError as e:
        raise error(str(e)) from None
    try:
        return settings.validate()
    except ConfigError as e:
        raise error(e.raw or str(e)) from None
