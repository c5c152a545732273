"""The ``all`` strategy equals open_clip's ``build_zero_shot_classifier`` on the same means:
a real (tiny, randomly initialised) open_clip CLIP, and zsprob's ProbCLIP through
``zsprob.models.encode_texts``."""
from __future__ import annotations

import json

import pytest
import torch

from zsprob.utils.paths import model_configs_dir
from zsprob.zeroshot.prompts import build_prompt_bank, load_templates
from zsprob.zeroshot.selection import select_all

CLASSES = ["star", "circle", "square", "heart", "crescent"]


def _tiny_open_clip():
    import open_clip

    cfg = json.loads((model_configs_dir() / "zsprob-tiny.json").read_text())
    torch.manual_seed(0)
    model = open_clip.CLIP(**cfg).eval()
    tok = open_clip.get_tokenizer("ViT-B-32", context_length=cfg["text_cfg"]["context_length"])
    return model, tok


@pytest.mark.slow
def test_all_equals_open_clip_build_zero_shot_classifier(tmp_path, monkeypatch):
    from open_clip.zero_shot_classifier import build_zero_shot_classifier

    model, tok = _tiny_open_clip()
    templates = load_templates()          # the 80 CLIP templates
    ref = build_zero_shot_classifier(model, tok, CLASSES, templates, num_classes_per_batch=2, device="cpu")

    def enc(m, texts, batch_size=512, **kw):
        with torch.no_grad():
            outs = [m.encode_text(tok(texts[i:i + batch_size])) for i in range(0, len(texts), batch_size)]
        return torch.cat(outs), None       # raw (unnormalised) means: the bank normalises per prompt

    monkeypatch.setattr("zsprob.models.encode.encode_texts", enc)
    bank = build_prompt_bank(model, CLASSES, templates, model_id="tiny", cache_dir=tmp_path, batch_size=97)
    sel = select_all(bank)
    assert ref.shape == (model.text_projection.shape[1], len(CLASSES))
    assert torch.allclose(sel.class_mu, ref.T, atol=1e-5)
    # and it differs from a single template, so the comparison has teeth
    assert not torch.allclose(bank.mu_normed[:, 0], ref.T, atol=1e-3)


@pytest.mark.slow
def test_all_equals_open_clip_on_probclip_means(tmp_path):
    """Same check through zsprob.models (ProbCLIP + encode_texts), with sigma heads present."""
    from open_clip.zero_shot_classifier import build_zero_shot_classifier

    from zsprob.models import create_model

    model = create_model("zsprob-tiny").eval()
    assert not model.deterministic

    class MeansOnly(torch.nn.Module):       # open_clip's function calls encode_text(tokens, normalize=True)
        def __init__(self, m):
            super().__init__()
            self.m = m

        def encode_text(self, tokens, normalize=False):
            mu, _ = self.m.encode_text(tokens)
            return torch.nn.functional.normalize(mu, dim=-1) if normalize else mu

    templates = load_templates()[:20]
    ref = build_zero_shot_classifier(MeansOnly(model), model.tokenizer, CLASSES, templates, device="cpu")
    bank = build_prompt_bank(model, CLASSES, templates, cache_dir=tmp_path, progress=False)
    assert bank.logvar is not None and bank.uncertainty.shape == (len(CLASSES), 20)
    assert torch.allclose(select_all(bank).class_mu, ref.T, atol=1e-5)
