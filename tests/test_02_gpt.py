"""Chapter 02: the GPT against Hugging Face's GPT2LMHeadModel, its two attention paths, checkpoints, training, perplexity.

Tolerances: fp32 logits agree with Hugging Face within atol=rtol=1e-5 (the two compute the same math in a
different order: Conv1D's addmm vs nn.Linear, fused vs explicit softmax); attention paths within 1e-5 as well.
Discrete results (weights after resume, reloaded checkpoints) must be bit-identical (torch.equal).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from minillm.core.attention import attention, attention_ref, causal_mask
from minillm.core.checkpoint import CONFIG_NAME, WEIGHTS_NAME, load_checkpoint, save_checkpoint
from minillm.gpt.pretrained import pretrained_dir
from minillm.core.config import GPTConfig
from minillm.gpt.eval import perplexity, token_nll
from minillm.core.model import GPT
from minillm.gpt.train import TrainConfig, lr_at, train

ATOL = RTOL = 1e-5

def _hf():
    """transformers is a dev extra: the parity tests skip without it."""
    return pytest.importorskip("transformers")


# Random-initialized GPT-2 shapes, including odd ones: 3 and 5 heads, odd vocabularies, a 1-layer model.
HF_SHAPES = [
    dict(vocab_size=101, n_positions=24, n_embd=36, n_layer=2, n_head=3),
    dict(vocab_size=257, n_positions=32, n_embd=64, n_layer=3, n_head=4),
    dict(vocab_size=53, n_positions=16, n_embd=20, n_layer=1, n_head=5, layer_norm_epsilon=1e-6),
]


def _hf_model(shape: dict, seed: int = 0):
    tr = _hf()
    torch.manual_seed(seed)
    cfg = tr.GPT2Config(**shape, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None, eos_token_id=None)
    hf = tr.GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():  # HF zero-inits biases and LayerNorm: randomize them so every tensor's mapping is tested
        for name, p in hf.named_parameters():
            if name.endswith("bias") or ".ln_" in name:
                p.normal_(0.0 if name.endswith("bias") else 1.0, 0.1)
    return hf


def _tiny(seed: int = 0, **overrides) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig.from_name("tiny", **overrides)).eval()


# ---- Hugging Face parity ------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", HF_SHAPES, ids=lambda s: f"V{s['vocab_size']}-C{s['n_embd']}-L{s['n_layer']}-H{s['n_head']}")
@pytest.mark.parametrize("attn_impl", ["sdpa", "explicit"])
def test_logits_match_hf_gpt2(shape, attn_impl):

    hf = _hf_model(shape)
    ours = GPT.from_hf(hf, attn_impl=attn_impl)
    x = torch.randint(0, shape["vocab_size"], (2, shape["n_positions"]))
    with torch.no_grad():
        torch.testing.assert_close(ours(x), hf(x).logits, atol=ATOL, rtol=RTOL)


def test_load_hf_from_state_dict_and_directory(tmp_path):

    shape = HF_SHAPES[0]
    hf = _hf_model(shape, seed=1)
    x = torch.randint(0, shape["vocab_size"], (1, 20))
    with torch.no_grad():
        want = hf(x).logits
        state = dict(hf.state_dict())
        state["transformer.h.0.attn.bias"] = torch.ones(1, 1, 24, 24)  # older transformers' mask buffer: ignored
        torch.testing.assert_close(GPT.from_hf(state, n_head=3)(x), want, atol=ATOL, rtol=RTOL)
        bare = {k.removeprefix("transformer."): v for k, v in hf.transformer.state_dict().items()}  # GPT2Model keys
        torch.testing.assert_close(GPT.from_hf(bare, n_head=3)(x), want, atol=ATOL, rtol=RTOL)
        hf.save_pretrained(tmp_path, safe_serialization=True)
        torch.testing.assert_close(GPT.from_hf(tmp_path)(x), want, atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(GPT.from_hf(str(tmp_path))(x), want, atol=ATOL, rtol=RTOL)


def test_to_hf_model_carries_our_weights():
    from minillm.core.hf import to_hf_model

    _hf()
    ours = _tiny(n_head=4)
    hf = to_hf_model(ours)
    x = torch.randint(0, 512, (2, 64))
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, ours(x), atol=ATOL, rtol=RTOL)
        back = GPT.from_hf(hf)
    assert all(torch.equal(a, b) for a, b in zip(ours.state_dict().values(), back.state_dict().values()))


@pytest.mark.parametrize("setting, value, match", [
    ("activation_function", "relu", "activation_function='relu'"),
    ("scale_attn_by_inverse_layer_idx", True, "scale_attn_by_inverse_layer_idx"),
    ("reorder_and_upcast_attn", True, "reorder_and_upcast_attn"),
    ("n_inner", 100, "n_inner=100"),
    ("tie_word_embeddings", False, "tie_word_embeddings"),
])
def test_load_hf_rejects_unsupported_settings(setting, value, match):
    from minillm.core.hf import hf_config_to_gpt

    cfg = dict(HF_SHAPES[0], model_type="gpt2", activation_function="gelu_new")
    cfg[setting] = value
    with pytest.raises(ValueError, match=match):
        hf_config_to_gpt(cfg)


def test_load_hf_bad_inputs(tmp_path):

    hf = _hf_model(HF_SHAPES[0])
    with pytest.raises(ValueError, match="n_head"):
        GPT.from_hf(hf.state_dict())  # a state dict cannot say how many heads
    with pytest.raises(ValueError, match="not found"):
        GPT.from_hf(tmp_path / "nope")
    with pytest.raises(TypeError, match="int"):
        GPT.from_hf(42)
    state = dict(hf.state_dict())
    state["transformer.h.0.mlp.c_fc.weight"] = state["transformer.h.0.mlp.c_fc.weight"][:, :-1]
    with pytest.raises(ValueError, match=r"transformer\.h\.0\.mlp\.c_fc\.weight.*\(143, 36\).*\(144, 36\)"):
        GPT.from_hf(state, n_head=3)


# ---- the two attention paths (graded: the chapter exercise is attention_ref) ---------------------------

@pytest.mark.graded(points=2, exercise="attention_ref")
def test_attention_ref_matches_sdpa_without_mask():
    q, k, v = (torch.randn(2, 3, 5, 8) for _ in range(3))
    torch.testing.assert_close(attention_ref(q, k, v), F.scaled_dot_product_attention(q, k, v), atol=1e-6, rtol=1e-5)


@pytest.mark.graded(points=3, exercise="attention_ref")
@pytest.mark.parametrize("T_q, T_k", [(7, 7), (1, 9), (4, 11)])
def test_attention_ref_matches_sdpa_with_causal_mask(T_q, T_k):
    q = torch.randn(2, 3, T_q, 16)
    k, v = torch.randn(2, 3, T_k, 16), torch.randn(2, 3, T_k, 16)
    mask = causal_mask(T_q, T_k)  # (T_q, T_k)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(attention_ref(q, k, v, mask), want, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(attention(q, k, v, mask), want, atol=0.0, rtol=0.0)


@pytest.mark.graded(points=2, exercise="attention_ref")
def test_attention_ref_one_visible_key_returns_its_value():
    """Worked example: if query i may see only key j, softmax puts weight 1 on j, so the output is v[j] exactly."""
    q, k, v = (torch.randn(1, 2, 4, 8) for _ in range(3))
    mask = torch.eye(4, dtype=torch.bool)  # query i sees key i only
    torch.testing.assert_close(attention_ref(q, k, v, mask), v, atol=1e-6, rtol=0)


@pytest.mark.graded(points=3, exercise="attention_ref")
@pytest.mark.parametrize("n_head", [1, 2, 4])
def test_gpt_explicit_attention_matches_sdpa(n_head):
    sdpa = _tiny(n_head=n_head)
    explicit = GPT(GPTConfig.from_name("tiny", n_head=n_head, attn_impl="explicit")).eval()
    explicit.load_state_dict(sdpa.state_dict())
    x = torch.randint(0, 512, (3, 64))
    with torch.no_grad():
        torch.testing.assert_close(explicit(x), sdpa(x), atol=ATOL, rtol=RTOL)


# ---- checkpoints ---------------------------------------------------------------------------------------

def test_forward_rejects_bad_ids_and_positions():
    torch.manual_seed(0)
    cfg = GPTConfig.from_name("tiny", block_size=16)
    model = GPT(cfg).eval()
    idx = torch.tensor([[1, 2, 3]])
    with pytest.raises(TypeError, match="idx must be an int64 tensor"):
        model(idx.float())
    with pytest.raises(ValueError, match=r"idx must have shape \(B, T\)"):
        model(idx[0])
    with pytest.raises(ValueError, match="T=0"):
        model(idx[:, :0])
    with pytest.raises(ValueError, match=f"idx holds token id {cfg.vocab_size}, which is outside the vocabulary"):
        model(torch.tensor([[1, cfg.vocab_size, 2]]))
    with pytest.raises(ValueError, match="idx holds token id -3, which is outside the vocabulary"):
        model(torch.tensor([[1, -3, cfg.vocab_size]]))
    with pytest.raises(ValueError, match="exceeds the context window"):
        model(torch.zeros(1, 17, dtype=torch.long))
    with pytest.raises(TypeError, match="positions must be an int64 tensor"):
        model(idx, positions=torch.tensor([0.0, 1.0, 2.0]))
    with pytest.raises(TypeError, match="positions must be an int64 tensor"):
        model(idx, positions=[0, 1, 2])
    with pytest.raises(ValueError, match=r"positions must have shape .* got \(2,\)"):
        model(idx, positions=torch.tensor([0, 1]))
    with pytest.raises(ValueError, match=r"got \(2, 3\)"):
        model(idx, positions=torch.zeros(2, 3, dtype=torch.long))  # batch of 1, positions for 2 rows
    with pytest.raises(ValueError, match="position 16 is outside the context window block_size=16"):
        model(idx, positions=torch.tensor([14, 15, 16]))
    with pytest.raises(ValueError, match="position -1 is outside"):
        model(idx, positions=torch.tensor([-1, 0, 1]))
    ok = model(idx, positions=torch.tensor([13, 14, 15], dtype=torch.int32))  # the last positions of the window
    assert ok.shape == (1, 3, cfg.vocab_size)


def test_dropout_acts_only_in_training():
    """Dropout changes the output while training and is exactly the identity at inference (p > 0 or not)."""
    torch.manual_seed(0)
    cfg = GPTConfig.from_name("tiny", dropout=0.5)
    model = GPT(cfg)
    plain = GPT(GPTConfig.from_name("tiny"))
    plain.load_state_dict(model.state_dict())  # same weights; dropout has no parameters
    idx = torch.randint(0, cfg.vocab_size, (2, 12))
    model.train()
    assert not torch.equal(model(idx), model(idx))  # two different dropout masks
    model.eval()
    plain.eval()
    assert torch.equal(model(idx), plain(idx))
    plain.train()  # p = 0: training mode changes nothing either
    assert torch.equal(plain(idx), model(idx))


def test_checkpoint_roundtrip(tmp_path):
    from safetensors.torch import load_file

    model = _tiny(seed=3)
    save_checkpoint(model, tmp_path, extra_metadata={"note": "test"})
    stored = load_file(str(tmp_path / WEIGHTS_NAME))
    assert "lm_head.weight" not in stored  # the tied head is stored once, as the embedding
    loaded = load_checkpoint(tmp_path)
    assert loaded.lm_head.weight is loaded.transformer.wte.weight  # re-tied
    assert loaded.config == model.config
    for (ka, a), (kb, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert ka == kb and torch.equal(a, b), ka
    assert not list(tmp_path.glob("*.tmp"))  # atomic writes leave no temp files behind


def _write_bad(tmp_path, edit):
    from safetensors.torch import load_file, save_file

    save_checkpoint(_tiny(), tmp_path)
    tensors = load_file(str(tmp_path / WEIGHTS_NAME))
    edit(tensors)
    save_file(tensors, str(tmp_path / WEIGHTS_NAME))


def test_checkpoint_missing_tensor_is_named(tmp_path):
    _write_bad(tmp_path, lambda t: t.pop("transformer.h.1.ln_2.bias"))
    with pytest.raises(ValueError, match=r"missing tensor 'transformer\.h\.1\.ln_2\.bias'.*\(32,\).*none"):
        load_checkpoint(tmp_path)


def test_checkpoint_extra_tensor_is_named(tmp_path):
    _write_bad(tmp_path, lambda t: t.__setitem__("transformer.h.2.ln_1.weight", torch.ones(32)))
    with pytest.raises(ValueError, match=r"unexpected tensor 'transformer\.h\.2\.ln_1\.weight' with shape \(32,\).*none"):
        load_checkpoint(tmp_path)


def test_checkpoint_misshaped_tensor_names_both_shapes(tmp_path):
    _write_bad(tmp_path, lambda t: t.__setitem__("transformer.wpe.weight", torch.zeros(63, 32)))
    with pytest.raises(ValueError, match=r"'transformer\.wpe\.weight' has shape \(63, 32\) but the model expects \(64, 32\)"):
        load_checkpoint(tmp_path)


def test_checkpoint_bad_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_checkpoint(tmp_path)
    (tmp_path / CONFIG_NAME).write_text('{"n_embd": 8}')
    with pytest.raises(ValueError, match="not a minillm checkpoint"):
        load_checkpoint(tmp_path)
    with pytest.raises(ValueError, match="'huge'"):
        pretrained_dir("huge")


# ---- training ------------------------------------------------------------------------------------------

def _byte_tokens() -> tuple[torch.Tensor, torch.Tensor]:
    """Bytes of a source file as token ids (< 256 < tiny's 512): a real, repetitive text with no tokenizer."""
    import minillm.core.model as m

    data = torch.tensor(list(open(m.__file__, "rb").read()), dtype=torch.int64)
    return data[:-2000], data[-2000:]


TINY = dict(preset="tiny", model_overrides=dict(block_size=32), batch_size=4, eval_interval=0, eval_windows=8,
            final_eval_tokens=0)


def test_training_lowers_the_loss():
    tr, va = _byte_tokens()
    cfg = TrainConfig(**{**TINY, "eval_interval": 15}, steps=30, warmup_steps=3, lr=3e-3, log_interval=1)
    result = train(cfg, tr, va, progress=False)
    losses = [h["loss"] for h in result.history]
    assert losses[0] > 5.5  # about ln(512) = 6.24 at initialization
    assert sum(losses[-5:]) / 5 < losses[0] - 2.0
    evals = result.log["evals"]
    assert [e["step"] for e in evals] == [15, 30] and evals[1]["val_loss"] < evals[0]["val_loss"]
    assert result.tokens_seen == 30 * 4 * 32


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_resume_is_bit_for_bit(tmp_path, grad_accum):
    """N steps straight == N/2 steps, a checkpoint, a fresh process state, N/2 more steps: identical weights."""
    tr, va = _byte_tokens()
    kw = dict(TINY, steps=8, warmup_steps=2, grad_accum=grad_accum, dropout=0.1)  # dropout: the RNG must resume too
    straight_run = train(TrainConfig(**kw, out_dir=str(tmp_path / "a")), tr, va, progress=False)
    straight = straight_run.model
    train(TrainConfig(**kw, out_dir=str(tmp_path / "b"), stop_after=4), tr, va, progress=False)
    torch.manual_seed(12345)  # a different global RNG state: resume must restore its own
    resumed = train(TrainConfig(**kw, out_dir=str(tmp_path / "b"), resume=str(tmp_path / "b")), tr, va,
                    progress=False)
    assert resumed.step == 8
    # the run's log too: the final train loss averages the last losses of both halves, as the straight run's does
    assert resumed.log["final_train_loss"] == straight_run.log["final_train_loss"]
    for (name, a), b in zip(straight.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(a, b), name


def test_training_is_seeded():
    tr, va = _byte_tokens()
    runs = [train(TrainConfig(**TINY, steps=2, warmup_steps=1, seed=s), tr, va, progress=False) for s in (0, 0, 1)]
    a, b, c = (r.model.transformer.wte.weight for r in runs)
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_weight_decay_groups():
    from minillm.gpt.train import make_optimizer

    model = _tiny()
    opt = make_optimizer(model, TrainConfig(weight_decay=0.1), torch.device("cpu"))
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() == 2 for p in decay["params"]) and all(p.dim() == 1 for p in no_decay["params"])
    assert sum(p.numel() for g in opt.param_groups for p in g["params"]) == model.num_params()  # tied head once


def test_lr_schedule_warmup_then_cosine():
    cfg = TrainConfig(steps=101, warmup_steps=10, lr=1.0, min_lr_ratio=0.1)
    lrs = [lr_at(cfg, s, s / 100, 10 / 100) for s in range(101)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)  # linear warm-up to the peak
    assert lrs[10] == pytest.approx(1.0) and lrs[100] == pytest.approx(0.1)  # cosine from the peak to the floor
    assert lrs[55] == pytest.approx(0.55)  # half-way down the cosine: the mean of peak and floor
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))


@pytest.mark.parametrize("field, value, match", [
    ("steps", 0, "steps"), ("lr", -1.0, "lr"), ("warmup_steps", 2000, "warmup_steps"), ("preset", "huge", "huge"),
    ("grad_accum", 0, "grad_accum"), ("beta2", 1.0, "beta2"), ("max_minutes", -1.0, "max_minutes"),
    ("device", "tpu", "tpu"), ("dropout", 1.0, "dropout"),
])
def test_train_config_rejects_bad_values(field, value, match):
    with pytest.raises((ValueError, TypeError), match=match):
        TrainConfig(**{field: value})


def test_train_rejects_tokens_outside_the_vocabulary():
    tr = torch.full((200,), 600, dtype=torch.int64)  # tiny has 512 ids
    with pytest.raises(ValueError, match="600"):
        train(TrainConfig(**TINY, steps=2, warmup_steps=1), tr, tr, progress=False)


def test_train_cli_with_a_small_tokenizer(tmp_path, capsys):
    from minillm.course.cli import main
    from minillm.tokenizer import train_bpe

    import minillm.core.model as m

    text = open(m.__file__, encoding="utf-8").read()
    (tmp_path / "corpus.txt").write_text(text * 2, encoding="utf-8")
    train_bpe(text[:8000], 300).to_tokenizer().save(tmp_path / "tok.json")
    code = main(["train", "--preset", "tiny", "--corpus", str(tmp_path / "corpus.txt"), "--tokenizer",
                 str(tmp_path / "tok.json"), "--steps", "4", "--warmup-steps", "1", "--batch-size", "2",
                 "--eval-interval", "2", "--export", str(tmp_path / "export"), "--no-progress"])
    assert code == 0
    assert "val perplexity" in capsys.readouterr().out
    model = load_checkpoint(tmp_path / "export")
    import json

    log = json.loads((tmp_path / "export" / "training_log.json").read_text())
    assert log["steps"] == 4 and math.isfinite(log["val_perplexity"]) and model.config.n_layer == 2


# ---- perplexity -----------------------------------------------------------------------------------------

def test_perplexity_is_exp_mean_nll_by_hand():
    """One window: ppl = exp(-(1/N) sum_t log softmax(logits[t])[x_{t+1}]), computed here with plain tensor ops."""
    model = _tiny(seed=5)
    tokens = torch.randint(0, 512, (41,))
    with torch.no_grad():
        logp = torch.log_softmax(model(tokens[None, :-1])[0], dim=-1)  # (40, V)
        nll = -logp[torch.arange(40), tokens[1:]]  # (40,)
    want = math.exp(nll.double().mean().item())
    assert perplexity(model, tokens) == pytest.approx(want, rel=1e-6)
    assert perplexity(model, tokens.tolist()) == pytest.approx(want, rel=1e-6)


@pytest.mark.parametrize("stride", [None, 1, 5])
def test_perplexity_windows_score_each_token_once(stride):
    """block_size=8: with stride=1 every token j >= 8 is predicted from exactly the 8 tokens before it."""
    model = _tiny(seed=6)
    tokens = torch.randint(0, 512, (30,))
    total, count = token_nll(model, tokens, block_size=8, stride=stride, batch_size=3)
    assert count == 29
    if stride == 1:
        want = 0.0
        with torch.no_grad():
            for j in range(29):  # target tokens[j+1] from inputs tokens[max(0, j-7) : j+1]
                ctx = tokens[max(0, j - 7) : j + 1]
                want -= torch.log_softmax(model(ctx[None])[0, -1], -1)[tokens[j + 1]].item()
        assert total == pytest.approx(want, rel=1e-5)


def test_perplexity_bad_inputs():
    model = _tiny()
    with pytest.raises(ValueError, match="at least 2 tokens"):
        perplexity(model, [3])
    with pytest.raises(ValueError, match="stride"):
        perplexity(model, list(range(10)), stride=0)
    with pytest.raises(ValueError, match="block_size"):
        perplexity(model, list(range(10)), block_size=65)


# ---- the shipped checkpoints ---------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["base", "draft"])
def test_shipped_checkpoint_loads(name):
    import minillm

    if not (pretrained_dir(name) / WEIGHTS_NAME).is_file():
        pytest.skip(f"checkpoint {name!r} not trained yet")
    model, tok = minillm.load(name)
    assert model.config.vocab_size == tok.vocab_size == 4096
    ids = tok.encode("def add(a, b):\n    return a + b\n")
    with torch.no_grad():
        logits = model(torch.tensor([ids]))
    assert logits.shape == (1, len(ids), 4096) and torch.isfinite(logits).all()


def test_draft_is_at_least_6x_smaller_than_base():
    base = GPT(GPTConfig.from_name("base")).num_params()
    draft = GPT(GPTConfig.from_name("draft")).num_params()
    assert base / draft >= 6.0


# ---- CUDA (skipped without a GPU) ------------------------------------------------------------------------

@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_forward_matches_cpu_and_bf16_training_runs():
    model = _tiny(seed=7)
    x = torch.randint(0, 512, (2, 64))
    with torch.no_grad():
        want = model(x)
        got = model.to("cuda")(x.to("cuda")).cpu()
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)  # different kernels: looser than CPU vs CPU
    tr, va = _byte_tokens()
    result = train(TrainConfig(**TINY, steps=4, warmup_steps=1, device="cuda"), tr, va, progress=False)
    assert result.model.device.type == "cuda" and all(math.isfinite(h["loss"]) for h in result.history)


def test_load_model_shipped_or_seeded_stand_in():
    """Shipped weights when present; otherwise seeded random weights of the preset's shape, flagged untrained."""
    from minillm.bench.models import load_model

    a = load_model("tiny", seed=3)
    b = load_model("tiny", seed=3)
    assert (a.trained, a.model.training, a.label) == (False, False, "tiny (random init: checkpoint missing)")
    assert a.model.config == GPTConfig.from_name("tiny") and a.tokenizer is not None
    assert all(torch.equal(x, y) for x, y in zip(a.model.state_dict().values(), b.model.state_dict().values()))
    if (pretrained_dir("base") / WEIGHTS_NAME).is_file():
        model, tok, trained, label = load_model("base")
        assert trained and tok is not None and not model.training and label == "base"


# ----- the causal mask by hand (the tests above build their reference with causal_mask itself) ------------------


def test_causal_mask_hand_written_matrices():
    """T_q == T_k: the lower triangle. T_q < T_k: the queries are the LAST T_q positions, so query 0 of a 2-query
    mask over 4 keys sits at position 2 and sees keys 0..2; a single query sees every key (a decode step)."""
    assert causal_mask(3, 3).tolist() == [[True, False, False],
                                          [True, True, False],
                                          [True, True, True]]
    assert causal_mask(2, 4).tolist() == [[True, True, True, False],
                                          [True, True, True, True]]
    assert causal_mask(1, 3).tolist() == [[True, True, True]]


def test_gpt_output_at_a_position_ignores_later_tokens():
    """Changing a later token never changes an earlier position's logits (an inverted mask lets it)."""
    model = _tiny()
    ids = torch.randint(0, model.config.vocab_size, (1, 10))
    other = ids.clone()
    other[0, 6:] = (other[0, 6:] + 1) % model.config.vocab_size
    with torch.no_grad():
        a, b = model(ids), model(other)  # (1, 10, V) each
    torch.testing.assert_close(a[:, :6], b[:, :6], atol=0.0, rtol=0.0)
    assert not torch.allclose(a[:, 6:], b[:, 6:])
