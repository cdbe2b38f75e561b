"""Registry: listing, choosing, refusal reasons, config JSON round trip."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ringjax
from ringjax.backends.xla import XlaConfig
from ringjax.dispatch import registry
from ringjax.options import AttentionOptions


@dataclasses.dataclass(frozen=True)
class FakeConfig:
    tile: int = 64


@dataclasses.dataclass(frozen=True)
class Refuses:
    """An implementation that runs nowhere, with a reason a person can act on."""

    name: str = "fake_refuses"
    config_type: type = FakeConfig

    def supports(self, problem):
        return f"head_dim {problem.head_dim} not supported by the fake kernel: needs a multiple of 64"

    def default_config(self, problem):
        return FakeConfig()

    def candidate_configs(self, problem):
        return [FakeConfig()]

    def run(self, problem, config, q, k, v, q_seg, kv_seg, sinks):
        raise AssertionError("a refusing implementation must never run")


REFUSES = Refuses()
HERE = jax.default_backend()  # the fakes run here or elsewhere, whichever machine runs the tests
ELSEWHERE = "gpu" if HERE == "tpu" else "tpu"


@pytest.fixture
def fakes():
    """Register fake implementations for this test only."""
    added = [
        registry.register("ring_attention", "fake_refuses", platforms=(HERE,), priority=100,
                          target=f"{__name__}:REFUSES"),
        registry.register("ring_attention", "fake_elsewhere", platforms=(ELSEWHERE,), priority=50,
                          target=f"{__name__}:REFUSES"),
        registry.register("ring_attention", "fake_missing", platforms=(HERE,), priority=40,
                          target="ringjax_no_such_module:IMPLEMENTATION"),
    ]
    yield added
    for reg in added:
        registry.unregister(reg.op, reg.name)


def _problem(head_dim=16):
    return registry.Problem(opts=AttentionOptions(), batch=1, seq=8, heads=2, kv_heads=1, head_dim=head_dim,
                            dtype="float32", platform=HERE)


def _qkv(seed=0, t=8):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((1, t, 2, 16)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((1, t, 1, 16)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((1, t, 1, 16)), jnp.float32)
    return q, k, v


def test_list_implementations(fakes):
    listed = {i["name"]: i for i in ringjax.list_implementations()}
    assert listed["xla"]["runs_here"] and listed["xla"]["platforms"] == ("cpu", "gpu", "tpu")
    assert listed["fake_elsewhere"]["runs_here"] is False
    names = [i["name"] for i in ringjax.list_implementations()]
    assert names.index("fake_refuses") < names.index("xla")  # highest priority first
    registry.unregister("ring_attention", "fake_elsewhere")
    fakes.remove(next(r for r in fakes if r.name == "fake_elsewhere"))
    assert "fake_elsewhere" not in [i["name"] for i in ringjax.list_implementations()]
    with pytest.raises(ValueError, match=r"op must be one of \['cache_attention', 'ring_attention'\], got 'rin'"):
        ringjax.list_implementations("rin")


def test_auto_skips_refusing_implementations(fakes):
    reg, impl = registry.choose("ring_attention", "auto", _problem())
    assert reg.name == "xla" and impl.name == "xla"


def test_named_refusal_explains(fakes):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"fake_refuses: head_dim 16 not supported by the fake kernel"):
        ringjax.ring_attention(q, k, v, axis_name=None, implementation="fake_refuses")


def test_every_refusal_is_listed(fakes):
    """With nothing able to run, the error names every candidate and its reason."""
    for reg in fakes:
        registry.register("fake_op", reg.name, platforms=reg.platforms, priority=reg.priority, target=reg.target)
    try:
        with pytest.raises(ValueError) as info:
            registry.choose("fake_op", "auto", _problem())
        message = str(info.value)
        assert "no implementation of fake_op" in message
        assert "fake_refuses: head_dim 16 not supported" in message
        assert f"fake_elsewhere: runs on {ELSEWHERE}, not {HERE}" in message
        assert "fake_missing: cannot be imported" in message
    finally:
        for reg in fakes:
            registry.unregister("fake_op", reg.name)


def test_unknown_name_lists_known():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"one of: .*xla.*got 'nope'"):
        ringjax.ring_attention(q, k, v, axis_name=None, implementation="nope")


def test_explicit_config_type_checked():
    q, k, v = _qkv()
    with pytest.raises(TypeError, match="must be a XlaConfig"):
        ringjax.ring_attention(q, k, v, axis_name=None, config=FakeConfig())
    with pytest.raises(ValueError, match="autotune must be one of"):
        ringjax.ring_attention(q, k, v, axis_name=None, autotune="always")


def test_config_json_round_trip():
    cfg = XlaConfig(block_q=128, block_kv=256)
    text = json.dumps(ringjax.config_to_json(cfg))
    assert ringjax.config_from_json(XlaConfig, json.loads(text)) == cfg

    @dataclasses.dataclass(frozen=True)
    class Tiles:
        sizes: tuple[int, int]
        name: str = "x"

    t = Tiles((8, 16))
    assert ringjax.config_from_json(Tiles, json.loads(json.dumps(ringjax.config_to_json(t)))) == t


@pytest.mark.parametrize(
    "data, match",
    [
        ({"block_q": 128, "block_kv": 64, "stages": 2}, "no field"),
        ({"block_q": 0}, "positive int"),
        ({"block_q": 128.5}, "positive int"),
        ({"block_q": True}, "positive int"),
        ([128, 128], "must be an object"),
    ],
)
def test_config_json_validation(data, match):
    with pytest.raises(ValueError, match=match):
        ringjax.config_from_json(XlaConfig, data)


def test_config_json_required_field():
    @dataclasses.dataclass(frozen=True)
    class Needs:
        block: int

    with pytest.raises(ValueError, match="lacks required"):
        ringjax.config_from_json(Needs, {})
    with pytest.raises(TypeError, match="dataclass instance"):
        ringjax.config_to_json({"block_q": 1})


def test_problem_resolves_device_kind():
    p = dataclasses.replace(_problem(), platform="cpu")
    assert p.device_kind == ""
    assert p.resolved().device_kind == registry.current_device_kind("cpu") == "cpu"


@dataclasses.dataclass(frozen=True)
class _FutureOptions(AttentionOptions):
    future_rule: int | None = None  # a feature no implementation has learnt yet


@pytest.mark.parametrize("name", ["xla", "pallas_triton_interpret", "pallas_tpu_interpret"])
def test_every_implementation_refuses_an_option_it_does_not_know(name):
    impl = next(r for r in registry.registrations("ring_attention") if r.name == name).load()
    problem = registry.Problem(opts=_FutureOptions(future_rule=3), batch=1, seq=64, heads=2, kv_heads=1,
                               head_dim=64, dtype="float32", platform="cpu")
    assert "future_rule" in impl.supports(problem)
    assert impl.supports(dataclasses.replace(problem, opts=_FutureOptions())) is None
