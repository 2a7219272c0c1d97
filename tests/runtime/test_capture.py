"""QueryCapture on the real llama.cpp: post-RoPE queries from the eval callback.

The queries are checked against llama.cpp's own attention: with flash attention off, the
``kq_soft_max-N`` node holds softmax(q·Kᵀ/√d + mask) per head, and ``cache_k_l<N> (view)`` is the K
cache that attention reads. Recomputing the softmax from the captured q and that K must reproduce it.
"""

from __future__ import annotations


import numpy as np
import pytest

from kvlocal.runtime import Context, Model
from policy import need
from kvlocal.runtime.capture import GgmlTensorHead, QueryCapture, ggml


TEXT = (
    "The lighthouse keeper counted the ships every evening. On Tuesday there were seven, on Wednesday "
    "nine, and on Thursday a storm kept every harbour closed. Which day had the most ships? "
)


def _read(t) -> np.ndarray:
    """The whole tensor `t` as a numpy array in ggml order reversed ([ne3, ne2, ne1, ne0]), any strides."""
    g, head = ggml(), GgmlTensorHead.from_address(t)
    dtype = {0: np.float32, 1: np.float16}[head.type]
    es = np.dtype(dtype).itemsize
    nbytes = g.nbytes(t)
    raw = np.empty(-(-nbytes // es), dtype=dtype)
    g.tensor_get(t, raw.ctypes.data, 0, nbytes)
    shape, strides = tuple(reversed(head.ne)), tuple(reversed(head.nb))
    return np.lib.stride_tricks.as_strided(raw, shape=shape, strides=strides).copy()


class Observer:
    """Test-only eval callback: copies whole nodes picked by (name, op)."""

    def __init__(self, wanted):
        self.wanted = {(n.encode(), op.encode()) for n, op in wanted}
        self.got: dict[tuple[str, str], list[np.ndarray]] = {}

    def _key(self, t):
        g = ggml()
        return g.get_name(t), g.op_desc(t)

    def callback(self, t, ask, user_data) -> bool:
        key = self._key(t)
        if ask:
            return key in self.wanted
        if key in self.wanted:
            self.got.setdefault((key[0].decode(), key[1].decode()), []).append(_read(t))
        return True

    def last(self, name, op):
        return self.got[(name, op)][-1]


def both(*callbacks):
    """One eval callback from several: a node is observed if any asks for it; each sees every data call."""

    def cb(t, ask, user_data):
        answers = [c(t, ask, user_data) for c in callbacks]
        return any(answers) if ask else all(answers)

    return cb


def _tokens(model, n):
    toks = model.tokenize(TEXT * (1 + n // 30))
    assert len(toks) >= n
    return toks[:n]


def _softmax_check(model: Model, layers, n_first=30, n_second=20, n_last=6):
    """Decode n_first tokens, then arm and decode n_second more; check kq_soft_max of the last n_last
    tokens against softmax(q·Kᵀ·scale + causal mask) from the captured q and the K cache view, with the
    model's own attention scale (``arch.attn_scale``)."""
    cap = QueryCapture.for_model(model)
    wanted = [(f"kq_soft_max-{il}", "SOFT_MAX") for il in layers] + [(f"cache_k_l{il} (view)", "VIEW") for il in layers]
    obs = Observer(wanted)
    ctx = Context(model, 768 if model.arch.has_swa else 256, cb_eval=both(cap.callback, obs.callback))
    toks = _tokens(model, n_first + n_second)
    ctx.decode(toks[:n_first], logits="none")
    cap.arm(n_last)
    ctx.decode(toks[n_first:])
    queries = cap.take()
    n_tok = n_first + n_second
    d, n_head, n_head_kv = cap.head_dim, model.n_head, model.n_head_kv
    scale = model.arch.attn_scale
    group = n_head // n_head_kv
    errors = {}
    for il in layers:
        probs = obs.last(f"kq_soft_max-{il}", "SOFT_MAX")  # ggml [n_kv, n_tokens, n_head, 1]
        keys = obs.last(f"cache_k_l{il} (view)", "VIEW")  # ggml [d, n_head_kv, n_kv, 1] f16
        assert probs.shape[:3] == (1, n_head, n_second) and keys.shape[2:] == (n_head_kv, d)
        n_kv = probs.shape[3]
        assert keys.shape[1] == n_kv >= n_tok
        probs = probs[0, :, -n_last:, :].astype(np.float64)  # [n_head, n_last, n_kv]
        keys = keys[0].astype(np.float64)  # [n_kv, n_head_kv, d]; a fresh context: cell j holds position j
        q = queries[cap.layers.index(il)].astype(np.float16).astype(np.float64)  # ggml's CPU matmul rounds q to K's f16
        assert q.shape == (n_head, n_last, d)
        qpos = np.arange(n_tok - n_last, n_tok)
        mask = np.where(np.arange(n_kv)[None, :] <= qpos[:, None], 0.0, -np.inf)  # [n_last, n_kv]
        worst = 0.0
        for h in range(n_head):
            s = q[h] @ keys[:, h // group, :].T * scale + mask
            p = np.exp(s - s.max(axis=1, keepdims=True))
            p /= p.sum(axis=1, keepdims=True)
            worst = max(worst, float(np.abs(p - probs[h]).max()))
            # the same check with the rows in reverse order must fail: the check tells tokens apart
            s_off = q[h][::-1] @ keys[:, h // group, :].T * scale + mask
            p_off = np.exp(s_off - s_off.max(axis=1, keepdims=True))
            p_off /= p_off.sum(axis=1, keepdims=True)
            assert np.abs(p_off - probs[h]).max() > 1e-2
        assert worst < 1e-4, f"layer {il}: max |softmax(qK) - kq_soft_max| = {worst}"
        assert np.all(probs[:, :, n_tok:] == 0)
        errors[il] = worst
    return errors


# -- (1) shapes, logits unchanged, arming --------------------------------------------------------
def test_shapes_and_logits_unchanged(smollm2_model):
    m = smollm2_model
    toks = _tokens(m, 40)
    plain = Context(m, 128)
    ref = plain.decode(toks, logits="all")
    cap = QueryCapture.for_model(m)
    assert (cap.n_layer, cap.n_head, cap.head_dim) == (30, 9, 64)
    ctx = Context(m, 128, cb_eval=cap.callback)
    cap.arm(8)
    assert cap.armed
    got = ctx.decode(toks, logits="all")
    assert np.allclose(got, ref, rtol=0, atol=1e-4), np.abs(got - ref).max()
    assert cap.n_graphs == 1 and cap.n_captured == 8
    q = cap.take()
    assert len(q) == 30
    for layer in q:
        assert layer.shape == (9, 8, 64) and layer.dtype == np.float32 and layer.flags.c_contiguous
        assert np.all(np.isfinite(layer)) and np.abs(layer).max() > 0
    assert not cap.armed and cap.n_captured == 0
    with pytest.raises(RuntimeError, match="no queries captured"):
        cap.take()

    # disarmed: the ask phase wants nothing, nothing is held, logits still match
    asked = []

    def counting(t, ask, ud):
        r = cap.callback(t, ask, ud)
        if ask:
            asked.append(r)
        return r

    m_ctx = Context(m, 128, cb_eval=counting)
    got = m_ctx.decode(toks, logits="all")
    assert asked and not any(asked)
    assert np.allclose(got, ref, rtol=0, atol=1e-4)

    # fewer tokens than n_last: what was decoded; the next decode's queries follow in order
    ctx2 = Context(m, 128, cb_eval=cap.callback)
    cap.arm(100)
    ctx2.decode(toks[:5], logits="none")
    ctx2.decode(toks[5:7], logits="none")
    q2 = cap.take()
    assert q2[0].shape == (9, 7, 64)
    # the same 7 tokens decoded in one call give the same queries, in the same order
    ctx3 = Context(m, 128, cb_eval=cap.callback)
    cap.arm(7)
    ctx3.decode(toks[:7], logits="none")
    q3 = cap.take()
    for a, b in zip(q2, q3):
        assert np.allclose(a, b, atol=1e-3)


def test_flash_attention_keeps_the_node(smollm2_model):
    """Flash attention removes kq_soft_max but not the ROPE Qcur-N node; layer 0's queries depend only
    on the embeddings, so they are the same with and without it."""
    m = smollm2_model
    toks = _tokens(m, 10)
    out = []
    for fa in (False, True):
        cap = QueryCapture.for_model(m)
        ctx = Context(m, 64, flash_attn=fa, cb_eval=cap.callback)
        cap.arm(4)
        ctx.decode(toks, logits="none")
        out.append(cap.take())
    assert [x.shape for x in out[1]] == [(9, 4, 64)] * 30
    assert np.array_equal(out[0][0], out[1][0])


def test_arm_validates_and_rearm_drops(smollm2_model):
    cap = QueryCapture.for_model(smollm2_model)
    with pytest.raises(ValueError):
        cap.arm(0)
    ctx = Context(smollm2_model, 64, cb_eval=cap.callback)
    toks = _tokens(smollm2_model, 12)
    cap.arm(4)
    ctx.decode(toks[:6], logits="none")
    cap.arm(3)  # re-arming drops what was held
    assert cap.n_captured == 0
    ctx.decode(toks[6:8], logits="none")
    cap.disarm()
    ctx.decode(toks[8:], logits="none")  # disarmed: ignored, rows already held are kept
    assert [x.shape for x in cap.take()[:1]] == [(9, 2, 64)]


def test_wrong_geometry_is_reported_not_aborting(smollm2_model):
    """A copy error must not stop the graph (logits stay right) and must surface in take()."""
    m = smollm2_model
    toks = _tokens(m, 10)
    ref = Context(m, 64).decode(toks)
    cap = QueryCapture(m.n_layer, m.n_head, 32)  # wrong head_dim
    ctx = Context(m, 64, cb_eval=cap.callback)
    cap.arm(4)
    got = ctx.decode(toks)
    assert np.allclose(got, ref, rtol=0, atol=1e-4)
    with pytest.raises(RuntimeError, match="query capture failed"):
        cap.take()


# -- (2) correctness against llama.cpp's attention ----------------------------------------------
def test_queries_reproduce_kq_soft_max_llama(smollm2_model):
    print("max abs error per layer:", _softmax_check(smollm2_model, layers=[0, 15, 29]))


def test_queries_reproduce_kq_soft_max_qwen2(qwen_model):
    """qwen2 adds a bias: Qcur-N is MUL_MAT, ADD, RESHAPE, ROPE — still the ROPE one is taken."""
    print("max abs error per layer:", _softmax_check(qwen_model, layers=[0, qwen_model.n_layer // 2], n_first=12, n_second=8, n_last=4))


def test_queries_match_reference_model(smollm2_model, smollm2):
    """The PyTorch reference forward (dequantized weights, f32 activations) gives the same queries up to
    quantization noise."""
    torch = need("torch")
    from kvlocal.reference import Transformer
    m = smollm2_model
    toks = _tokens(m, 24)
    cap = QueryCapture.for_model(m)
    ctx = Context(m, 64, cb_eval=cap.callback)
    cap.arm(6)
    ctx.decode(toks, logits="none")
    got = cap.take()
    ref = Transformer.from_gguf(smollm2)
    _, queries = ref(torch.tensor(toks), torch.arange(len(toks)), ref.new_cache(), capture_queries=True)
    worst = 1.0
    for il in range(m.n_layer):
        r = queries[il][:, -6:, :].float().numpy()  # [Hq, 6, d]
        cos = (r * got[il]).sum(-1) / (np.linalg.norm(r, axis=-1) * np.linalg.norm(got[il], axis=-1))
        worst = min(worst, float(cos.min()))
        assert cos.min() > 0.99, f"layer {il}: min cosine {cos.min():.4f}"
    print("min cosine over layers, heads, tokens:", worst)


# -- (3) batches and ubatches -------------------------------------------------------------------
LAYERS = (0, 14, 29)


def _all_rows(obs, il):
    """Every ROPE Qcur-il row the observer saw, in order: [n, n_head, d]."""
    return np.concatenate([x[0] for x in obs.got[(f"Qcur-{il}", "ROPE")]])


def test_batches_keep_last_rows(smollm2_model):
    """Context.decode splits 150 tokens into llama_decode calls of 64, 64, 22: the last 32 rows span two."""
    m = smollm2_model
    cap = QueryCapture.for_model(m)
    obs = Observer([(f"Qcur-{il}", "ROPE") for il in LAYERS])
    ctx = Context(m, 256, n_batch=64, cb_eval=both(cap.callback, obs.callback))
    cap.arm(32)
    ctx.decode(_tokens(m, 150), logits="none")
    assert cap.n_graphs == 3
    q = cap.take()
    for il in LAYERS:
        rows = _all_rows(obs, il)
        assert rows.shape == (150, 9, 64)
        assert np.array_equal(q[il], rows[-32:].transpose(1, 0, 2))


def test_ubatches_keep_last_rows(smollm2_model):
    """n_batch 1024 > n_ubatch 512: llama.cpp splits one llama_decode of 530 tokens into 512 + 18."""
    m = smollm2_model
    cap = QueryCapture.for_model(m)
    obs = Observer([(f"Qcur-{il}", "ROPE") for il in LAYERS])
    ctx = Context(m, 1024, n_batch=1024, cb_eval=both(cap.callback, obs.callback))
    cap.arm(32)
    ctx.decode(_tokens(m, 530), logits="none")
    assert cap.n_graphs == 2
    assert [x.shape[1] for x in obs.got[("Qcur-0", "ROPE")]] == [512, 18]
    q = cap.take()
    for il in LAYERS:
        assert np.array_equal(q[il], _all_rows(obs, il)[-32:].transpose(1, 0, 2))


def test_gemma3_queries_reproduce_its_full_attention_layers(gemma3):
    """Gemma 3: only the full-attention layers are captured (the ones kvlocal compresses), head size 256
    (key_length, not n_embd/n_head = 160), and the softmax with the model's query scale reproduces
    llama.cpp's attention in each of them."""
    m = Model(gemma3)
    cap = QueryCapture.for_model(m)
    assert cap.layers == (5, 11, 17) and cap.head_dim == 256
    errors = _softmax_check(m, cap.layers)
    print("gemma3 max |softmax - kq_soft_max| per layer:", errors)
