"""dispatch / explain / use / environment overrides, end to end with fake implementations."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import gla_core
from gla_core.errors import ImplementationDeclinedError, InvalidArgumentError, UnknownOpError
from gla_ref.testing import TOLERANCES

B, T, H, K, V = 1, 10, 2, 8, 4


def qkv(dtype=jnp.float32):
    kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    return (
        jax.random.normal(kq, (B, T, H, K), dtype),
        jax.random.normal(kk, (B, T, H, K), dtype),
        jax.random.normal(kv, (B, T, H, V), dtype),
    )


@pytest.fixture
def three_impls(install_registry, fake_impl, plugin_of):
    install_registry(
        plugin_of(
            fake_impl("fast", 100, supports=lambda call: "needs a gate" if not call.gates else None),
            fake_impl("middle", 50),
            fake_impl("slow", 10),
        )
    )


def test_dispatch_runs_the_highest_priority_accepting_impl(three_impls, ran):
    q, k, v = qkv()
    assert ran(gla_core.dispatch("simple_gla", q, k, v, g=jnp.zeros((B, T, H)))) == "fast"
    assert ran(gla_core.dispatch("simple_gla", q, k, v)) == "middle"


def test_impl_keyword_forces_an_implementation(three_impls, ran):
    assert ran(gla_core.dispatch("simple_gla", *qkv(), impl="slow")) == "slow"


def test_impl_keyword_fails_with_the_implementations_reason(three_impls):
    with pytest.raises(ImplementationDeclinedError, match="needs a gate"):
        gla_core.dispatch("simple_gla", *qkv(), impl="fast")


def test_use_overrides_priority_and_nests(three_impls, ran):
    q, k, v = qkv()
    with gla_core.use(simple_gla="slow"):
        assert ran(gla_core.dispatch("simple_gla", q, k, v)) == "slow"
        with gla_core.use(simple_gla="middle"):
            assert ran(gla_core.dispatch("simple_gla", q, k, v)) == "middle"
        assert ran(gla_core.dispatch("simple_gla", q, k, v)) == "slow"
    assert ran(gla_core.dispatch("simple_gla", q, k, v)) == "middle"


def test_environment_variable_overrides_priority(three_impls, monkeypatch, ran):
    monkeypatch.setenv("GLA_IMPL_SIMPLE_GLA", "slow")
    assert ran(gla_core.dispatch("simple_gla", *qkv())) == "slow"


def test_precedence_is_impl_then_use_then_environment(three_impls, monkeypatch, ran):
    monkeypatch.setenv("GLA_IMPL_SIMPLE_GLA", "slow")
    with gla_core.use(simple_gla="middle"):
        assert ran(gla_core.dispatch("simple_gla", *qkv())) == "middle"
        assert ran(gla_core.dispatch("simple_gla", *qkv(), impl="slow")) == "slow"


def test_override_naming_a_declining_impl_says_where_it_came_from(three_impls, monkeypatch):
    monkeypatch.setenv("GLA_IMPL_SIMPLE_GLA", "fast")
    with pytest.raises(ImplementationDeclinedError, match="GLA_IMPL_SIMPLE_GLA=fast"):
        gla_core.dispatch("simple_gla", *qkv())


def test_explain_lists_every_candidate_and_the_winner(three_impls):
    resolution = gla_core.explain("simple_gla", *qkv())
    verdicts = {c.implementation.name: c.reason for c in resolution.candidates}
    assert verdicts == {"fast": "needs a gate", "middle": None, "slow": None}
    assert resolution.winner.name == "middle"
    assert "declined: needs a gate" in str(resolution)


def test_explain_accepts_shape_structs(three_impls):
    structs = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in qkv()]
    cu = jax.ShapeDtypeStruct((3,), jnp.int32)
    resolution = gla_core.explain("simple_gla", *structs, cu_seqlens=cu)
    assert resolution.call.num_sequences == 2


def test_use_backend_changes_the_target_backend(install_registry, fake_impl, plugin_of, ran):
    install_registry(plugin_of(fake_impl("tpu_kernel", 100, backends={"tpu"}), fake_impl("portable", 1)))
    assert ran(gla_core.dispatch("simple_gla", *qkv())) == "portable"
    with gla_core.use(backend="tpu"):
        assert gla_core.backend() == "tpu"
        assert ran(gla_core.dispatch("simple_gla", *qkv())) == "tpu_kernel"


@pytest.mark.parametrize("source", ["call", "use", "env"])
def test_interpret_mode_reaches_the_call(install_registry, fake_impl, plugin_of, monkeypatch, source):
    seen = []
    impl = fake_impl("chunk", 100, backends={"tpu"}, interpretable=True)
    impl = gla_core.Implementation(**{**impl.__dict__, "fn": lambda args: seen.append(args.interpret) or args.q.sum()})
    install_registry(plugin_of(impl))
    kwargs = {"interpret": True} if source == "call" else {}
    if source == "env":
        monkeypatch.setenv("GLA_INTERPRET", "1")
    with gla_core.use(interpret=True) if source == "use" else gla_core.use():
        gla_core.dispatch("simple_gla", *qkv(), **kwargs)
    assert seen == [True]


def test_implementation_receives_every_normalized_keyword(install_registry, fake_impl, plugin_of):
    received = {}
    impl = fake_impl("probe", 1)
    impl = gla_core.Implementation(**{**impl.__dict__, "fn": lambda args: received.update(vars(args)) or args.q.sum()})
    install_registry(plugin_of(impl))
    gla_core.dispatch("simple_gla", *qkv())
    assert {"q", "k", "v"} <= set(received) and received["options"].values == ()
    assert received["scale"] == pytest.approx(K**-0.5)
    assert received["chunk_size"] == 64 and received["interpret"] is False
    assert set(received) >= {"g", "g_gamma", "initial_state", "output_final_state", "cu_seqlens"}


def test_unknown_op_is_rejected(three_impls):
    with pytest.raises(UnknownOpError, match="'attention'"):
        gla_core.dispatch("attention", *qkv())


def test_use_rejects_unknown_ops_and_backends():
    with pytest.raises(UnknownOpError), gla_core.use(attention="x"):
        pass
    with pytest.raises(InvalidArgumentError, match="backend"), gla_core.use(backend="fpga"):
        pass


def test_bad_gla_interpret_environment_value_is_rejected(three_impls, monkeypatch):
    monkeypatch.setenv("GLA_INTERPRET", "maybe")
    with pytest.raises(InvalidArgumentError, match="GLA_INTERPRET"):
        gla_core.dispatch("simple_gla", *qkv())


def test_dispatch_works_under_jit_with_traced_cu_seqlens(install_registry, fake_impl, plugin_of):
    def first_boundary_plus_sum(args):
        return args.q.sum() + args.cu_seqlens[1], None

    impl = gla_core.Implementation(**{**fake_impl("sum", 1).__dict__, "fn": first_boundary_plus_sum})
    install_registry(plugin_of(impl))
    q, k, v = qkv()

    @jax.jit
    def run(cu):
        return gla_core.dispatch("simple_gla", q, k, v, cu_seqlens=cu)[0]

    assert run(jnp.array([0, 3, T])) == pytest.approx(float(q.sum()) + 3, rel=TOLERANCES["float32_rearranged"].output)


# ------------------------------------------------------------------ overrides under jax.jit


@pytest.fixture
def array_impls(install_registry, fake_impl, plugin_of):
    """Two implementations whose outputs differ (q + 1 and q + 2), so a jitted result shows which ran."""

    def adding(amount):
        def fn(args):
            return args.q + amount, None

        return fn

    install_registry(
        plugin_of(
            gla_core.Implementation(**{**fake_impl("one", 20).__dict__, "fn": adding(1.0)}),
            gla_core.Implementation(**{**fake_impl("two", 10).__dict__, "fn": adding(2.0)}),
        )
    )


def test_use_takes_effect_on_an_already_jitted_function(array_impls):
    q, k, v = qkv()
    f = jax.jit(lambda q, k, v: gla_core.dispatch("simple_gla", q, k, v)[0])
    assert float(f(q, k, v)[0, 0, 0, 0] - q[0, 0, 0, 0]) == 1.0
    with gla_core.use(simple_gla="two"):
        assert float(f(q, k, v)[0, 0, 0, 0] - q[0, 0, 0, 0]) == 2.0
    assert float(f(q, k, v)[0, 0, 0, 0] - q[0, 0, 0, 0]) == 1.0


def test_use_of_an_unknown_implementation_raises_for_an_already_jitted_function(array_impls):
    q, k, v = qkv()
    f = jax.jit(lambda q, k, v: gla_core.dispatch("simple_gla", q, k, v)[0])
    f(q, k, v)
    with gla_core.use(simple_gla="no_such_impl"), pytest.raises(gla_core.errors.UnknownImplementationError):
        f(q, k, v)


def test_use_is_per_thread_for_jitted_functions(array_impls):
    import threading

    q, k, v = qkv()
    f = jax.jit(lambda q, k, v: gla_core.dispatch("simple_gla", q, k, v)[0])
    f(q, k, v)
    seen = {}

    def in_thread():
        with gla_core.use(simple_gla="two"):
            seen["thread"] = float(f(q, k, v)[0, 0, 0, 0] - q[0, 0, 0, 0])

    with gla_core.use(simple_gla="one"):
        thread = threading.Thread(target=in_thread)
        thread.start()
        thread.join()
        seen["main"] = float(f(q, k, v)[0, 0, 0, 0] - q[0, 0, 0, 0])
    assert seen == {"thread": 2.0, "main": 1.0}


def test_an_op_without_any_implementation_names_the_package_to_install(install_registry, fake_impl, plugin_of):
    install_registry(plugin_of(fake_impl("only_gla", 1, op="gla")))
    with pytest.raises(gla_core.errors.NoImplementationError, match="pip install gla-simple"):
        gla_core.dispatch("simple_gla", *qkv())
