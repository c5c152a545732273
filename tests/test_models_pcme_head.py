"""PCME's local-attention uncertainty modules (model.sigma_head pcme): shapes, padding, gradient
flow, a tiny training run that lowers the loss, and the one-line error for towers without local
features."""
from __future__ import annotations

import pytest
import torch

from tests.conftest import run_cli
from conftest import TINY_TOWERS
from zsprob import UserError
from zsprob.models import create_model
from zsprob.models.sigma_heads import PCMEUncertaintyHead

TINY = TINY_TOWERS


pytestmark = pytest.mark.usefixtures("one_thread")  # the fixture is in conftest.py


def _model(**kw):
    return create_model("zsprob-tiny", embed_dim=16, sigma_head="pcme", sigma_param="logsigma", seed=0, **TINY, **kw)


def test_shapes_and_gradient_flow():
    model = _model()
    assert isinstance(model.image_sigma, PCMEUncertaintyHead) and isinstance(model.text_sigma, PCMEUncertaintyHead)
    assert hasattr(model.image_sigma, "fc2") and isinstance(model.text_sigma.rnn, torch.nn.GRU)
    images = torch.randn(3, 3, 32, 32)
    tokens = model.tokenizer(["a red star", "two large blue circles on the left", "a dog"])
    out = model(images, tokens)
    for side in ("img", "txt"):
        assert out[f"{side}_mu"].shape == out[f"{side}_logvar"].shape == (3, 16)
    (out["img_logvar"].sum() + out["txt_logvar"].sum()).backward()
    for head in (model.image_sigma, model.text_sigma):
        for name, p in head.named_parameters():
            if name == "rnn.weight_hh_l0_reverse":
                # as the official code: the backward GRU's output at the last token has seen only that
                # token from a zero state, so its recurrent weight gets no gradient
                continue
            assert p.grad is not None and p.grad.abs().sum() > 0, name
    # gradients reach the shared tower through the local features
    assert model.clip.visual.transformer.resblocks[-1].mlp.c_proj.weight.grad.abs().sum() > 0


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
    torch.testing.assert_close(y[0], ref)
    img = PCMEUncertaintyHead("image", 8, 6).double()
    pooled = torch.randn(2, 8, dtype=torch.float64)
    a = torch.softmax(img.w2(torch.tanh(img.w1(x))).squeeze(-1), dim=1)
    torch.testing.assert_close(img(x, pooled=pooled), img.fc((a[..., None] * x).sum(1)) + img.fc2(pooled))


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


def test_towers_without_local_features_are_refused():
    with pytest.raises(UserError, match="local features"):
        create_model("zsprob-tiny-cnn", embed_dim=16, sigma_head="pcme", seed=0)
    with pytest.raises(UserError, match="probabilistic"):
        create_model("zsprob-tiny", embed_dim=16, sigma_head="pcme", deterministic=True)


def test_cli_pcme_head_on_a_bag_of_words_tower_is_one_line_exit_2(tmp_path):
    r = run_cli("pretrain", "--data", "synthetic", "--shards", str(tmp_path), "--out", str(tmp_path / "run"),
                "--method", "pcme", "--model", "zsprob-tiny-bow", "--set", "model.pretrained=null",
                "--set", "model.sigma_head=pcme", "--steps", "1", "--no-progress")
    assert r.returncode == 2, r.stderr[-2000:]
    lines = [x for x in r.stderr.strip().splitlines() if x.strip()]
    assert len(lines) == 1 and "local features" in lines[0] and "Traceback" not in r.stderr
