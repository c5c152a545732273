"""PCME's local-attention uncertainty modules (model.sigma_head pcme) on every tower kind: open_clip ViT and
text transformer, a timm CNN (plain CNN, ResNet) and the bag of words. Shapes, gradient flow, padding,
the masked attention against a float64 direct computation, checkpoints, tiny training runs that lower
the loss, and the one-line errors."""
from __future__ import annotations

import pytest
import torch

from conftest import TINY_TOWERS, read_losses, run_cli
from zsprob import UserError
from zsprob.models import create_model
from zsprob.models.sigma_heads import PCMEUncertaintyHead

TINY = TINY_TOWERS
# zsprob-tiny-bow (plain CNN + bag of words) at 32 px and zsprob-tiny-cnn (timm ResNet + text transformer) at
# 64 px, with narrow text towers: both CNNs end on 2 x 2 cells (one cell would leave the attention nothing to weigh)
BOW_SMALL = {"open_clip_cfg": {"vision_cfg": {"image_size": 32}, "text_cfg": {"width": 24, "context_length": 16}}}
CNN_SMALL = {"open_clip_cfg": {"vision_cfg": {"image_size": 64},
                               "text_cfg": {"layers": 2, "width": 32, "heads": 2, "context_length": 16}}}
MODELS = {"zsprob-tiny": TINY, "zsprob-tiny-bow": BOW_SMALL, "zsprob-tiny-cnn": CNN_SMALL}
CAPTIONS = ["a red star", "two large blue circles on the left", "a dog"]


pytestmark = pytest.mark.usefixtures("one_thread")  # the fixture is in conftest.py


def _model(name: str = "zsprob-tiny", **kw):
    return create_model(name, embed_dim=16, sigma_head="pcme", sigma_param="logsigma", seed=0, **MODELS[name], **kw)


@pytest.mark.parametrize("name", list(MODELS))
def test_shapes_and_gradient_flow(name):
    model = _model(name)
    assert isinstance(model.image_sigma, PCMEUncertaintyHead) and isinstance(model.text_sigma, PCMEUncertaintyHead)
    assert hasattr(model.image_sigma, "fc2") and isinstance(model.text_sigma.rnn, torch.nn.GRU)
    if model._vision.kind == "timm":  # the module reads the CNN's final channels
        assert model.image_sigma.w1.in_features == model.clip.visual.trunk.num_features
    images = torch.randn(3, 3, model.image_size, model.image_size)
    out = model(images, model.tokenizer(CAPTIONS))
    for side in ("img", "txt"):
        assert out[f"{side}_mu"].shape == out[f"{side}_logvar"].shape == (3, 16)
    (out["img_logvar"].sum() + out["txt_logvar"].sum()).backward()
    for head in (model.image_sigma, model.text_sigma):
        for pname, p in head.named_parameters():
            if pname == "rnn.weight_hh_l0_reverse":
                # as the official code: the backward GRU's output at the last token has seen only that
                # token from a zero state, so its recurrent weight gets no gradient
                continue
            assert p.grad is not None and p.grad.abs().sum() > 0, pname
    # gradients reach the shared towers through the local features (sigma alone was differentiated); a
    # timm ResNet's last stage starts with zero-initialised residual norms, so look at any of its parameters
    def reached(module):
        return any(p.grad is not None and p.grad.abs().sum() > 0 for p in module.parameters())
    assert reached(model._vision.blocks[-1])
    assert reached(model.clip.text.token_embedding if model._text.kind == "bow" else model._text.blocks[-1])


def test_text_module_ignores_padding_and_reads_attention_as_official():
    torch.manual_seed(0)
    head = PCMEUncertaintyHead("text", 8, 6).double()
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    lengths = torch.tensor([3, 5])
    y = head(x, lengths=lengths)
    x2 = x.clone()
    x2[0, 3:] = 100.0  # padding content must not matter
    torch.testing.assert_close(head(x2, lengths=lengths), y)
    # float64 reference of row 0: attention over 3 tokens + the GRU output at the last valid token
    a = torch.softmax(head.w2(torch.tanh(head.w1(x[0, :3]))).squeeze(-1), dim=0)
    gru, _ = head.rnn(x[:1, :3])
    ref = head.fc((a[:, None] * x[0, :3]).sum(0)) + gru[0, -1]
    torch.testing.assert_close(y[0], ref, rtol=1e-12, atol=1e-12)
    img = PCMEUncertaintyHead("image", 8, 6).double()
    pooled = torch.randn(2, 8, dtype=torch.float64)
    a = torch.softmax(img.w2(torch.tanh(img.w1(x))).squeeze(-1), dim=1)
    torch.testing.assert_close(img(x, pooled=pooled), img.fc((a[..., None] * x).sum(1)) + img.fc2(pooled),
                               rtol=1e-12, atol=1e-12)


def _direct_attention(head: PCMEUncertaintyHead, cells: torch.Tensor) -> torch.Tensor:
    """Lin et al.'s one-head attention written out for one sample's valid local features [T, w]:
    a_t = exp(e_t) / sum_s exp(e_s), e_t = w2 . tanh(W1 x_t); returns sum_t a_t x_t [w]."""
    w1, w2 = head.w1.weight, head.w2.weight[0]
    scores = torch.stack([w2 @ torch.tanh(w1 @ cell) for cell in cells])
    weights = torch.exp(scores - scores.max())
    weights = weights / weights.sum()
    return sum(a * cell for a, cell in zip(weights, cells))


def test_bag_of_words_module_equals_a_float64_direct_computation():
    """Text log sigma^2 of the bag-of-words tower = 2 (fc(attention over the caption's word vectors) + GRU at its
    last word), every caption written out on its own valid words (no padding anywhere)."""
    model = _model("zsprob-tiny-bow").double().eval()
    tokens = model.tokenizer(CAPTIONS)
    with torch.no_grad():
        _, logvar = model.encode_text(tokens)
        head = model.text_sigma
        for row, caption in enumerate(tokens):
            words = model.clip.text.token_embedding(caption[caption != 0])  # start-of-text .. end-of-text
            gru, _ = head.rnn(words[None])
            direct = head.fc(_direct_attention(head, words)) + gru[0, -1]
            torch.testing.assert_close(logvar[row], 2 * direct, rtol=1e-10, atol=1e-10)


def test_cnn_module_equals_a_float64_direct_computation():
    """Image log sigma^2 of the plain CNN = 2 (fc(attention over the last stage's H x W cells) + fc2(their mean)),
    from the trunk's own feature map."""
    model = create_model("zsprob-tiny-bow", embed_dim=16, sigma_head="pcme", sigma_param="logsigma", seed=0)
    model = model.double().eval()  # 64 px: a 4 x 4 final map
    images = torch.randn(2, 3, 64, 64, dtype=torch.float64)
    with torch.no_grad():
        _, logvar = model.encode_image(images)
        fmap = model.clip.visual.trunk.forward_features(images)  # [B, C, 4, 4]
        assert fmap.shape[2:] == (4, 4)
        head = model.image_sigma
        for row in range(2):
            cells = fmap[row].flatten(1).t()  # [16, C]
            direct = head.fc(_direct_attention(head, cells)) + head.fc2(cells.mean(0))
            torch.testing.assert_close(logvar[row], 2 * direct, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("timm_name", ["zsprob_plaincnn_small", "test_resnet", "test_efficientnet", "test_convnext",
                                       "regnetx_002"])
def test_cnn_local_features_are_the_last_stage_cells_and_timms_pooled_feature(timm_name):
    """Every timm family zsprob cuts: the image module reads the H x W cells of the final map (as many as
    timm's forward_features has, with its channels) and timm's own pooled feature (forward_head's pre-logits)."""
    over = {"open_clip_cfg": {"vision_cfg": {"timm_model_name": timm_name, "image_size": 64},
                              "text_cfg": CNN_SMALL["open_clip_cfg"]["text_cfg"]}}
    model = create_model("zsprob-tiny-cnn", embed_dim=16, sigma_head="pcme", seed=0, **over).eval()
    tower, trunk = model._vision, model.clip.visual.trunk
    images = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        x = tower.embed(images)[0]
        for block in tower.blocks:
            x = block(x)
        cells, pooled = tower.local_features(x, None)
        fmap = trunk.forward_features(images)
        assert cells.shape == (2, fmap.shape[2] * fmap.shape[3], trunk.num_features)
        torch.testing.assert_close(pooled, trunk.forward_head(fmap, pre_logits=True))
        assert model.image_sigma.w1.in_features == trunk.num_features
        assert torch.isfinite(model.encode_image(images)[1]).all()


def test_padding_does_not_change_the_bag_of_words_sigma():
    """A caption batched with a longer one (so padded) gets the log sigma^2 it gets alone; the padding
    token has a word vector of its own, so without the mask (attention and GRU over every position) it
    would not."""
    model = _model("zsprob-tiny-bow").eval()
    short, batch = model.tokenizer(CAPTIONS[:1]), model.tokenizer(CAPTIONS[:2])
    with torch.no_grad():
        alone = model.encode_text(short)[1][0]
        padded = model.encode_text(batch)[1][0]
        torch.testing.assert_close(padded, alone)
        words, _, lengths = model.clip.text.embed(batch)
        assert int(lengths[0]) < words.shape[1]  # the first caption really is padded
        unmasked = model.text_sigma(words, lengths=torch.full_like(lengths, words.shape[1]))[0]
    assert not torch.allclose(2 * unmasked, alone, atol=1e-3)


@pytest.mark.parametrize("name", ["zsprob-tiny-bow", "zsprob-tiny-cnn"])
def test_checkpoint_round_trip(name, tmp_path):
    from zsprob.models import load, save
    model = _model(name).eval()
    with torch.no_grad():  # move the heads off their init so a head rebuilt at random cannot pass
        for p in list(model.image_sigma.parameters()) + list(model.text_sigma.parameters()):
            p.add_(0.01 * torch.randn_like(p))
    ckpt = save(model, tmp_path / "ckpt", extra={"method": "pcme"})
    back = load(ckpt).eval()
    assert back.sigma_head == "pcme" and back.sigma_param == "logsigma"
    assert isinstance(back.image_sigma, PCMEUncertaintyHead) and isinstance(back.text_sigma.rnn, torch.nn.GRU)
    images, tokens = torch.randn(2, 3, model.image_size, model.image_size), model.tokenizer(CAPTIONS[:2])
    with torch.no_grad():
        for a, b in zip(model(images, tokens).values(), back(images, tokens).values()):
            assert torch.equal(a, b)


def test_tiny_training_run_lowers_the_pcme_loss():
    from zsprob.prob import PCMELoss
    model = _model()
    loss_fn = PCMELoss(n_samples=3)
    g = torch.Generator().manual_seed(0)
    images = torch.randn(8, 3, 32, 32, generator=g)
    tokens = model.tokenizer([f"a {c} {s}" for c in ("red", "blue") for s in ("star", "circle", "square", "cross")])
    params = list(model.parameters()) + list(loss_fn.parameters())
    opt = torch.optim.Adam(params, lr=2e-3)
    losses = []
    for step in range(12):
        out = model(images, tokens)
        loss, _ = loss_fn(out["img_mu"], out["img_logvar"], out["txt_mu"], out["txt_logvar"],
                          generator=torch.Generator().manual_seed(step))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert sum(losses[-3:]) < 0.8 * sum(losses[:3])


def test_synthworld_run_with_the_bag_of_words_lowers_the_loss_and_reloads(tiny_world, tmp_path):
    """--method pcme with sigma_head pcme on the demo's towers (plain CNN + bag of words) through the
    training loop on SynthWorld shards: the loss falls and the saved model rebuilds with the head."""
    from zsprob.models import load
    from zsprob.train import train
    cfg = {"seed": 0, "method": "pcme",
           "model": {"name": "zsprob-tiny-bow", "embed_dim": 16, "sigma_head": "pcme", "pooling": "native",
                     "overrides": {**BOW_SMALL, "sigma_bias_init": -3.0}},
           "loss": {"pcme": {"n_samples": 3}},
           "data": {"kind": "synthetic", "shards": str(tiny_world / "pretrain"), "batch_size": 16, "num_workers": 0,
                    "shuffle_buffer": 32, "augment": False, "pipeline": {"caption_key": "json:captions"}},
           "optim": {"name": "adamw", "lr": 2e-3, "weight_decay": 0.01},
           "schedule": {"name": "constant", "steps": 16, "warmup_steps": 0},
           "train": {"log_every": 1, "checkpoint_every": 0, "tensorboard": False, "threads": 1}}
    train(cfg, tmp_path / "run", progress=False)
    losses = read_losses(tmp_path / "run")
    first, last = sum(losses[s] for s in (1, 2, 3, 4)), sum(losses[s] for s in (13, 14, 15, 16))
    assert last < 0.9 * first, (first, last)
    model = load(tmp_path / "run" / "model")
    assert isinstance(model.image_sigma, PCMEUncertaintyHead) and model.sigma_param == "logsigma"


def test_towers_without_local_features_are_refused(monkeypatch):
    from zsprob.models import prob_clip
    # every tower adapter zsprob builds gives local features; one that did not would be refused
    monkeypatch.setattr(prob_clip._BowTextTower, "local_features", None, raising=False)
    with pytest.raises(UserError, match="local features"):
        create_model("zsprob-tiny-bow", embed_dim=16, sigma_head="pcme", seed=0)
    with pytest.raises(UserError, match="probabilistic"):
        create_model("zsprob-tiny", embed_dim=16, sigma_head="pcme", deterministic=True)


def test_cli_pcme_head_with_an_odd_embedding_is_one_line_exit_2(tmp_path):
    """The bag of words is accepted now; the text module's GRU (D / 2 per direction) still refuses an odd D."""
    r = run_cli("pretrain", "--data", "synthetic", "--shards", str(tmp_path), "--out", str(tmp_path / "run"),
                "--method", "pcme", "--model", "zsprob-tiny-bow", "--set", "model.pretrained=null",
                "--set", "model.sigma_head=pcme", "--set", "model.embed_dim=15", "--steps", "1", "--no-progress")
    assert r.returncode == 2, r.stderr[-2000:]
    lines = [x for x in r.stderr.strip().splitlines() if x.strip()]
    assert len(lines) == 1 and "even embedding size" in lines[0] and "Traceback" not in r.stderr
