"""Property tests over the settings Structs (Hypothesis).

1. Any configuration (random keys, random values of any type: numbers in and far out of
   range, nan and inf, text, lists, maps, nulls; in the file and in VELOCITY_*
   variables) either loads or is refused with a ConfigError in the one form,
   ``<source>: <key>: <why>`` on one line. Nothing else may escape.
2. A configuration drawn inside the documented ranges (every numeric key of every Struct,
   from its msgspec Meta) loads, and a gateway started with it in front of a sim engine
   never answers 500 to ordinary requests (a few examples: each starts a gateway).
"""

from __future__ import annotations

import asyncio
import re

import msgspec
import orjson
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.sim import SimEngine, http_request
from velocity_fast.admission.settings import AdmissionSettings, BandSettings
from velocity_fast.config import ConfigError, ServerSettings, Settings, TenantConfig, load_settings
from velocity_fast.fleet.health import HealthSettings
from velocity_fast.gateway.app import Gateway
from velocity_fast.routing.settings import RoutingSettings

# The key: words, dots, [0] indices, <name> for a map's key, ["..."] for a key that is no word.
FORM = re.compile(r'^[^\n:]+: (?:[\w.<>]|\[(?:\d+|"(?:[^"\\\n]|\\.)*")\])+: [^\n]+$')
SCALARS = [
    f
    for f in Settings.__struct_fields__
    if f not in ("endpoints", "models", "bands", "tenants", "admission", "routing", "health", "server", "sim")
]

# -- 1. anything at all ------------------------------------------------------------------------

_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0, -1, 1, 0.5, 1e-9, 1e300, 2**31, 2**63, "", "0", "-1", "fast", "1e999"]),
    st.text(max_size=8),
)
_any = st.recursive(
    _leaf,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)),
    max_leaves=6,
)


def _section(cls) -> st.SearchStrategy:
    """A mapping of some of the Struct's keys (and now and then an unknown one) to anything."""
    keys = st.sampled_from(list(cls.__struct_fields__) + ["unknown_key"])
    return st.dictionaries(keys, _any, max_size=4)


_any_config = st.fixed_dictionaries(
    {},
    optional={
        **{k: _any for k in SCALARS},
        "admission": st.one_of(_section(AdmissionSettings), _any),
        "routing": st.one_of(_section(RoutingSettings), _any),
        "health": st.one_of(_section(HealthSettings), _any),
        "server": st.one_of(_section(ServerSettings), _any),
        "bands": st.one_of(st.lists(_section(BandSettings), max_size=3), _any),
        "tenants": st.one_of(st.lists(_section(TenantConfig), max_size=3), _any),
        "endpoints": st.one_of(
            st.lists(
                st.dictionaries(st.sampled_from(["name", "url", "model", "api_key"]), _any, max_size=4), max_size=2
            ),
            _any,
        ),
        "models": _any,
        "sim": _any,
        "not_a_key": _any,
    },
)
_any_env = st.dictionaries(
    st.sampled_from([f"VELOCITY_{k.upper()}" for k in SCALARS] + ["VELOCITY_ENDPOINTS"]),
    st.text(max_size=12),
    max_size=3,
)


@pytest.mark.timeout(300)
@settings(max_examples=400, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(config=_any_config, env=_any_env)
def test_any_config_loads_or_is_refused_in_the_one_form(tmp_path_factory, config, env):
    _loads_or_is_refused(tmp_path_factory, config, env)


def _loads_or_is_refused(tmp_path_factory, config: dict, env: dict) -> None:
    f = tmp_path_factory.mktemp("c") / "c.yaml"
    try:
        f.write_text(yaml.safe_dump(config))
    except (ValueError, UnicodeEncodeError):  # text YAML cannot hold (lone surrogates)
        return
    try:
        load_settings(str(f), {}, env=env)
    except ConfigError as e:
        assert FORM.match(str(e)), f"not <source>: <key>: <why>: {str(e)!r}"


# -- 2. in range: the gateway serves ----------------------------------------------------------------


def _number(t: msgspec.inspect.Type) -> st.SearchStrategy:
    if isinstance(t, msgspec.inspect.IntType):
        lo = t.ge if t.ge is not None else (t.gt + 1 if t.gt is not None else -(2**31))
        hi = t.le if t.le is not None else (t.lt - 1 if t.lt is not None else 2**31)
        if t.multiple_of:
            return st.integers(-(-lo // t.multiple_of), hi // t.multiple_of).map(lambda k: k * t.multiple_of)
        return st.one_of(st.sampled_from([lo, hi]), st.integers(lo, hi))
    lo = t.ge if t.ge is not None else t.gt
    hi = t.le if t.le is not None else t.lt
    floats = st.floats(
        min_value=lo,
        max_value=hi,
        exclude_min=t.ge is None and lo is not None,
        exclude_max=t.le is None and hi is not None,
        allow_nan=False,
        allow_infinity=False,
    )
    ends = [v for v, ok in ((lo, t.ge is not None), (hi, t.le is not None)) if v is not None and ok]
    return st.one_of(st.sampled_from(ends), floats) if ends else floats


def _in_range(cls, skip: tuple[str, ...] = ()) -> st.SearchStrategy:
    """Some of the Struct's numeric keys, each drawn inside its declared range."""
    fields = {}
    for f in msgspec.inspect.type_info(cls).fields:
        t = f.type
        if isinstance(t, msgspec.inspect.UnionType):
            rest = [m for m in t.types if not isinstance(m, msgspec.inspect.NoneType)]
            t = rest[0] if len(rest) == 1 else t
        if f.name not in skip and isinstance(t, (msgspec.inspect.IntType, msgspec.inspect.FloatType)):
            fields[f.name] = _number(t)
    return st.fixed_dictionaries({}, optional=fields)


@st.composite
def _served_config(draw) -> dict:
    n_bands = draw(st.integers(1, 4))
    ceilings = sorted(
        draw(
            st.lists(
                _number(msgspec.inspect.type_info(BandSettings).fields[1].type), min_size=n_bands, max_size=n_bands
            )
        ),
        reverse=True,
    )
    bands = [
        {"name": f"b{i}", "ceiling": c, **draw(_in_range(BandSettings, ("ceiling",)))} for i, c in enumerate(ceilings)
    ]
    tenants = [
        {
            "name": f"t{i}",
            "max_band": draw(st.none() | st.sampled_from([b["name"] for b in bands])),
            **draw(_in_range(TenantConfig)),
        }
        for i in range(draw(st.integers(0, 3)))
    ]
    admission = draw(_in_range(AdmissionSettings))
    lo, hi = sorted((admission.get("aimd_min", 1), admission.get("aimd_max", 32)))
    if "aimd_min" in admission or "aimd_max" in admission:
        admission["aimd_min"], admission["aimd_max"] = lo, hi
    admission["default_band"] = draw(st.sampled_from([b["name"] for b in bands]))
    admission["fairness"] = draw(st.sampled_from(["rr", "tokens"]))
    top = draw(_in_range(Settings, ("port", "admin_port", "max_concurrency")))
    top["max_concurrency"] = max(admission.get("aimd_min", 1), draw(st.integers(1, 64)))
    return {
        **top,
        "policy": draw(st.sampled_from(["static", "dynamic", "smart"])),
        "bands": bands,
        "tenants": tenants,
        "admission": admission,
        "routing": {
            **draw(_in_range(RoutingSettings)),
            "default_profile": draw(st.sampled_from(["chat", "batch", "long-context", "round-robin", "least-loaded"])),
            "prefix": draw(st.sampled_from(["approximate", "off"])),
        },
        "health": draw(_in_range(HealthSettings)),
        "server": draw(_in_range(ServerSettings, ("max_header_bytes", "max_body_bytes"))),
    }


@pytest.fixture(scope="module")
def engine():
    with SimEngine(model="m1", time_scale=100).start() as eng:
        yield eng


async def _call(port: int, method: str, path: str, body: bytes | None = None, headers=None) -> int:
    """The status; 0 for a connection closed without an answer (a timeout of a few ms
    closes a connection before its first byte: documented, and no 500)."""
    try:
        return (await http_request(port, method, path, body, headers=headers, timeout=20)).status
    except (asyncio.IncompleteReadError, ConnectionError):
        return 0


async def _requests(gw: Gateway, cfg: dict) -> list[tuple[str, int]]:
    """Ordinary requests, one at a time; (what, status) of each."""
    chat = orjson.dumps({"model": "m1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
    comp = orjson.dumps({"model": "m1", "prompt": "hi", "max_tokens": 2})
    gen = orjson.dumps({"prompt": "hi", "max_tokens": 2})
    out = []
    for tenant in [None] + [t["name"] for t in cfg["tenants"][:2]]:
        for band in [None, cfg["bands"][0]["name"], cfg["bands"][-1]["name"]]:
            hdrs = {"content-type": "application/json"}
            if tenant:
                hdrs["x-velocity-tenant"] = tenant
            if band:
                hdrs["x-velocity-priority"] = band
            for method, path, body in [
                ("POST", "/v1/chat/completions", chat),
                ("POST", "/v1/completions", comp),
                ("POST", "/generate", gen),
            ]:
                out.append((f"{path} tenant={tenant} band={band}", await _call(gw.port, method, path, body, hdrs)))
    for path in ("/v1/models", "/health", "/stats"):
        out.append((path, await _call(gw.port, "GET", path)))
    for path in ("/metrics", "/ready", "/stats"):
        out.append((f"admin {path}", await _call(gw.admin_port, "GET", path)))
    return out


@pytest.mark.timeout(300)
@settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(cfg=_served_config())
def test_a_config_in_range_starts_a_gateway_that_never_answers_500(tmp_path_factory, engine, cfg):
    f = tmp_path_factory.mktemp("c") / "c.yaml"
    f.write_text(
        yaml.safe_dump(
            {
                **cfg,
                "host": "127.0.0.1",
                "port": 0,
                "admin_port": 0,
                "endpoints": [{"name": "e1", "url": engine.url, "model": "m1"}],
            }
        )
    )
    s = load_settings(str(f), {}, env={})

    async def run() -> list[tuple[str, int]]:
        gw = Gateway(s)
        await gw.start("127.0.0.1", 0, 0)
        try:
            return await _requests(gw, cfg)
        finally:
            await gw.stop(grace=0.5)

    statuses = asyncio.run(run())
    assert [(what, st) for what, st in statuses if st == 500] == [], (cfg, statuses)


_SECTIONS = {
    "admission": AdmissionSettings,
    "routing": RoutingSettings,
    "health": HealthSettings,
    "server": ServerSettings,
    "bands": BandSettings,
    "tenants": TenantConfig,
}


@st.composite
def _nearly_valid_config(draw) -> dict:
    """A config in range with one to three keys set to anything: so that each value reaches
    the checks deep inside a section, past the ones a random config fails first."""
    cfg = draw(_served_config())
    for _ in range(draw(st.integers(1, 3))):
        where = draw(st.sampled_from(["top", *_SECTIONS]))
        if where == "top":
            cfg[draw(st.sampled_from(SCALARS + ["endpoints", "models", "sim", "not_a_key"]))] = draw(_any)
            continue
        cls = _SECTIONS[where]
        key = draw(st.sampled_from(list(cls.__struct_fields__) + ["unknown_key"]))
        if where in ("bands", "tenants"):
            if not cfg[where]:
                cfg[where] = [{"name": "x", "ceiling": 1.0}] if where == "bands" else [{"name": "x"}]
            cfg[where][draw(st.integers(0, len(cfg[where]) - 1))][key] = draw(_any)
        else:
            cfg[where][key] = draw(_any)
    return cfg


@pytest.mark.timeout(300)
@settings(max_examples=600, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(config=_nearly_valid_config())
def test_a_config_with_a_few_bad_values_loads_or_is_refused_in_the_one_form(tmp_path_factory, config):
    _loads_or_is_refused(tmp_path_factory, config, {})
