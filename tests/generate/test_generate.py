"""Generation with the KV cache: greedy ids equal Hugging Face `generate` (greedy, float32,
tools/make_hf_fixtures.py's generate.npy) on every committed fixture; each step's cached
logits equal the uncached full forward's; tensor x expert sharding, left padding, per-layer
params, EOS and sampling behave."""

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxmoe.convert.from_hf import read_hf
from maxmoe.generate.decode import Decoder, decode_config, left_pad
from maxmoe.generate.mesh import decode_rules
from maxmoe.generate.sampling import Sampling, choose, top_p_filter
from tests.helpers import per_layer

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "hf"
NAMES = sorted(p.name for p in FIXTURES.iterdir())
# measured at most 5.5e-6 (float32, logits of size ~1): the cache path reorders the sums
# (absorbed MLA k_nope / v, gathered experts), so not bit-identical; 1e-4 as conversion asserts
LOGITS_TOL = 1e-4


def fixture(name):
    cfg, params, _, _ = read_hf(FIXTURES / name)
    return cfg, params, np.load(FIXTURES / name / "input_ids.npy")


def full_logits(decoder: Decoder, tokens: np.ndarray) -> np.ndarray:
    """The uncached forward (Transformer.__call__) over whole rows, one device: [B, S, V]."""
    ids = jnp.asarray(tokens)
    positions = jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape)
    run = jax.jit(lambda m, x, pos: m(x, jnp.ones_like(x), pos)[0])
    return np.asarray(run(decoder.model, ids, positions))


def greedy(decoder, ids, n=8, **kw):
    return decoder.generate(ids, np.zeros(len(ids), np.int32), n, record_logits=True, **kw)


def assert_cached_logits_match(decoder, out, p):
    """The logits each new token came from equal the full forward's at the position before it."""
    n = out.logits.shape[1]
    want = full_logits(decoder, out.tokens)[:, p - 1:p - 1 + n]
    np.testing.assert_allclose(out.logits, want, atol=LOGITS_TOL, rtol=0)


@pytest.mark.parametrize("name", NAMES)
def test_greedy_equals_hf_generate_and_the_uncached_forward(name):
    cfg, params, ids = fixture(name)
    decoder = Decoder(cfg, params, mesh={})
    out = greedy(decoder, ids)
    want = np.load(FIXTURES / name / "generate.npy")
    assert out.tokens.dtype == np.int32 and out.tokens.shape == want.shape
    np.testing.assert_array_equal(out.tokens, want)
    assert out.steps == 8
    assert_cached_logits_match(decoder, out, ids.shape[1])


@pytest.mark.parametrize("name, mesh", [
    ("mixtral", {"tensor": 2, "expert": 4}),
    ("deepseek_v3_qlora_interleave_yarn", {"tensor": 2, "expert": 4}),
    ("deepseek_v2_lite_greedy", {"tensor": 2, "fsdp": 2}),
])
def test_sharded_decoding_equals_one_device(name, mesh):
    """Fake devices, heads / MLP / vocab over tensor=2 and experts over expert=4 (batch 2 not
    split: the expert axis does not divide it), or tensor=2 x fsdp=2 (batch split over fsdp;
    experts unsplit, so decode steps gather them, decode_moe.py): the same greedy ids as one
    device's (generate.npy, equal to them by the test above) and the same logits."""
    cfg, params, ids = fixture(name)
    decoder = Decoder(cfg, params, mesh=mesh)
    assert decoder.sizes == {"data": 1, "pipeline": 1, "fsdp": 1, "expert": 1, **mesh}
    out = greedy(decoder, ids)
    np.testing.assert_array_equal(out.tokens, np.load(FIXTURES / name / "generate.npy"))
    assert_cached_logits_match(decoder, out, ids.shape[1])


def test_left_padded_row_decodes_as_it_would_alone():
    """Row 1 cut to its last 5 tokens and left-padded to 12: its tokens and logits equal those
    of the 5-token prompt decoded alone (positions and mask ignore the padding)."""
    cfg, params, ids = fixture("deepseek_v2_lite_greedy")
    decoder = Decoder(cfg, params, mesh={})
    batch, pad = left_pad([ids[0].tolist(), ids[1, -5:].tolist()], pad_id=7)
    assert pad.tolist() == [0, 7] and (batch[1, :7] == 7).all()
    both = decoder.generate(batch, pad, 6, record_logits=True)
    alone = decoder.generate(ids[1:, -5:], np.zeros(1, np.int32), 6, record_logits=True)
    np.testing.assert_array_equal(both.tokens[1, 12:], alone.tokens[0, 5:])
    np.testing.assert_allclose(both.logits[1], alone.logits[0], atol=1e-5, rtol=0)
    # row 0 is unpadded: HF's greedy tokens
    hf = np.load(FIXTURES / "deepseek_v2_lite_greedy" / "generate.npy")
    np.testing.assert_array_equal(both.tokens[0, 12:], hf[0, 12:18])


def test_per_layer_params_generate_the_same():
    """model.scan_layers=false (each layer's params and cache apart, layers unrolled)."""
    cfg, params, ids = fixture("deepseek_v3_groups_dense")
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, scan_layers=False))
    out = greedy(Decoder(cfg, per_layer(params), mesh={}), ids)
    np.testing.assert_array_equal(out.tokens,
                                  np.load(FIXTURES / "deepseek_v3_groups_dense" / "generate.npy"))


def test_eos_stops_each_row_and_pads_after_it():
    """With eos = the 3rd greedy token of row 0 (HF's), row 0 keeps it and then holds pad ids;
    row 1 runs on as without EOS up to its own first EOS, if any."""
    name = "mixtral"
    cfg, params, ids = fixture(name)
    want = np.load(FIXTURES / name / "generate.npy")
    eos = int(want[0, 12 + 2])
    out = Decoder(cfg, params, mesh={}).generate(ids, np.zeros(2, np.int32), 8, eos_id=eos,
                                                 pad_id=63)
    expected = want.copy()
    for row in range(2):
        hits = np.flatnonzero(want[row, 12:] == eos)
        if hits.size:
            expected[row, 12 + hits[0] + 1:] = 63
    np.testing.assert_array_equal(out.tokens, expected)
    stops = [np.flatnonzero(want[r, 12:] == eos) for r in range(2)]
    assert out.steps == (max(s[0] for s in stops) + 1 if all(s.size for s in stops) else 8)
    # one row: the loop ends at its EOS, the rest of the output is padding
    alone = Decoder(cfg, params, mesh={}).generate(ids[:1], np.zeros(1, np.int32), 8,
                                                   eos_id=eos, pad_id=63)
    assert alone.steps == stops[0][0] + 1 < 8
    np.testing.assert_array_equal(alone.tokens, expected[:1])


def test_top_p_keeps_the_smallest_nucleus():
    logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.15, 0.05], [0.1, 0.2, 0.3, 0.4]]))
    kept = np.isfinite(np.asarray(top_p_filter(logits, 0.7)))
    assert kept.tolist() == [[True, True, False, False], [False, False, True, True]]
    assert np.isfinite(np.asarray(top_p_filter(logits, 0.01))).sum(axis=1).tolist() == [1, 1]


def test_sampling_follows_temperature_seed_and_top_p():
    """Default sampling is the argmax; a nucleus of one token (top_p 1e-6) is the argmax at
    temperature 1; sampling at temperature 1 is reproducible for one key and differs across 8
    keys."""
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(4, 64)), jnp.float32)
    key = jax.random.key(0)
    greedy_ids = np.asarray(choose(logits, Sampling(), key))
    np.testing.assert_array_equal(greedy_ids, np.argmax(np.asarray(logits), axis=-1))
    # a nucleus of one token is greedy at any temperature
    np.testing.assert_array_equal(np.asarray(choose(logits, Sampling(1.0, 1e-6), key)),
                                  greedy_ids)
    draws = [np.asarray(choose(logits, Sampling(1.0), jax.random.key(s))) for s in range(8)]
    np.testing.assert_array_equal(draws[0], np.asarray(choose(logits, Sampling(1.0),
                                                              jax.random.key(0))))
    assert len({d.tobytes() for d in draws}) > 1  # different keys, different draws


def test_sampled_generation_is_reproducible_per_seed():
    cfg, params, ids = fixture("qwen3_moe_sparse_step")
    decoder = Decoder(cfg, params, mesh={})
    pad = np.zeros(2, np.int32)
    runs = [decoder.generate(ids, pad, 8, Sampling(1.5, 0.95, seed)).tokens
            for seed in (1, 1, 2)]
    np.testing.assert_array_equal(runs[0], runs[1])
    assert not np.array_equal(runs[0], runs[2])


def test_decode_rules_split_the_batch_only_over_axes_that_divide_it():
    cfg, _, _ = fixture("mixtral")
    sizes = {"data": 2, "fsdp": 2, "pipeline": 1, "expert": 4, "tensor": 1}
    assert decode_rules(cfg, sizes, 1)["batch"] == []
    assert decode_rules(cfg, sizes, 2)["batch"] == ["data"]
    assert decode_rules(cfg, sizes, 4)["batch"] == ["data", "fsdp"]
    assert decode_rules(cfg, sizes, 16)["batch"] == ["data", "fsdp", "expert"]
    assert decode_rules(cfg, sizes, 4)["experts"] == ["expert"]  # weights keep the run's rules


def test_decoding_is_dropless_whatever_the_run_trained_with():
    cfg, _, _ = fixture("mixtral")
    capacity = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, dispatch="capacity"))
    assert decode_config(capacity, "bfloat16").moe.dispatch == "dropless"
    assert decode_config(capacity, "bfloat16").precision.compute_dtype == "bfloat16"
    assert decode_config(cfg, "float32", experts_split=True).moe.grouped_matmul == "ragged_dot"
