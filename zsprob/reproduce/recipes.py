"""The reproduction recipes: each published result as the zsprob commands that measure it, with the paper's
figures copied from the paper.

A recipe is configuration: the commands are the ones a user would type (``eval coco``, ``finetune coco``,
``pretrain``, ``zeroshot --compare``), with the paper's settings. Every figure is copied from the paper, with
its table and row named. PCME++ (Chun, ICLR 2024): Table 1 (means of three runs, i2t and t2i averaged),
Table C.9 (the same runs' means with standard errors; in the text extraction the ViT-B/32 and ViT-B/16
InfoNCE rows of C.9 are swapped, and the row whose means equal Table 1's B/32 InfoNCE is used), and
Table 6 (ImageNet zero-shot, ViT-S/16 pretrained on RedCaps). ProLIP (Chun et al., ICLR 2025): its
abstract, 74.6% ImageNet zero-shot with ViT-B/16 and 75.8% with uncertainty-based prompt re-weighting
under a few-shot setting, whose shots are ImageNet validation images (docs/zeroshot.md, Protocols).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from zsprob.models.catalogue import PROLIP_PAPER_MODEL

#: Table 1 columns, as ``zsprob eval coco`` names them in metrics.json's "summary"
COCO_COLUMNS = ("ECCV mAP@R", "ECCV R-P", "ECCV R@1", "CxC R@1", "COCO 1K R@1", "COCO 5K R@1", "RSUM")


def _row(*values, se=None) -> dict:
    """{column: (paper value, paper SE or None)} of a Table 1 row (RSUM has no SE in Table C.9)."""
    ses = list(se or [None] * 6) + [None]
    return {c: (v, s) for c, v, s in zip(COCO_COLUMNS, values, ses)}


#: PCME++ Table 1, by backbone and row
TABLE1 = {
    "ViT-B-32": {"CLIP ZS": _row(26.8, 36.9, 67.1, 42.0, 59.5, 40.3, 471.9),
                 "InfoNCE": _row(39.0, 48.7, 81.7, 54.9, 74.0, 53.0, 532.6, se=(0.3, 0.2, 1.0, 0.2, 0.3, 0.1)),
                 "PCME": _row(39.1, 48.9, 81.4, 54.7, 73.8, 53.0, 532.0, se=(0.1, 0.1, 0.4, 0.2, 0.1, 0.3)),
                 "Ours": _row(40.0, 49.6, 83.3, 57.0, 75.5, 55.3, 537.1, se=(0.1, 0.1, 0.6, 0.1, 0.2, 0.1)),
                 "Ours + SWA": _row(40.2, 49.8, 83.6, 57.2, 75.6, 55.5, 537.3, se=(0.1, 0.2, 0.4, 0.2, 0.1, 0.2))},
    "ViT-B-16": {"CLIP ZS": _row(29.3, 39.0, 71.1, 44.3, 62.0, 42.7, 481.0),
                 "Ours w/ SWA": _row(42.0, 51.1, 86.6, 63.1, 79.7, 61.6, 548.9, se=(0.0, 0.1, 0.5, 0.1, 0.1, 0.1))},
    "ViT-L-14": {"CLIP ZS": _row(28.0, 37.8, 72.2, 48.1, 64.8, 46.4, 491.6),
                 "Ours": _row(42.1, 50.8, 88.8, 65.9, 81.8, 64.3, 554.7)},
}
#: the Table 1 row of each backbone's official PCME++ checkpoint (B/32, B/16: SWA; L/14: no SWA run)
OFFICIAL_ROW = {"ViT-B-32": "Ours + SWA", "ViT-B-16": "Ours w/ SWA", "ViT-L-14": "Ours"}
#: the Table 1 row of each method trained by recipe pcmepp-table1-train (ViT-B/32)
TRAIN_ROW = {"pcmepp": "Ours", "infonce": "InfoNCE", "pcme": "PCME"}
#: PCME++ Table 6 (ViT-S/16 on RedCaps, PCME++): the paper's row -> (the --compare row that measures it, top-1)
TABLE6 = {'"A photo of {}"': ("single", 8.58), "All 80 prompts": ("all", 9.33),
          "Top-K certain prompts (K = 13, chosen on the evaluation labels)": ("oracle-global", 9.37),
          "Best top-K for each class (chosen on the evaluation labels)": ("oracle", 14.75)}
#: ProLIP's abstract, ViT-B/16 (DataComp, 12.8B seen samples), the same way
PROLIP = {"ImageNet zero-shot, ViT-B/16": ("all", 74.6),
          "with uncertainty-based prompt re-weighting, few-shot (evaluation images as shots)": ("bprw-fewshot", 75.8)}


@dataclass(frozen=True)
class Recipe:
    """One published result: ``data`` (folders under --data-root it reads), ``variants`` (the first is the
    default), whether it needs ``--pretrained``, and why zsprob cannot run it (``unsupported``)."""

    name: str
    title: str
    source: str
    data: tuple[str, ...] = ()
    variants: tuple[str, ...] = ()
    needs_pretrained: bool = False
    seeds: bool = False
    unsupported: str | None = None
    notes: list[str] = field(default_factory=list)


RECIPES = {r.name: r for r in (
    Recipe("pcmepp-table1-eval", "PCME++ official COCO checkpoints, evaluated",
           "PCME++ (ICLR 2024) Table 1, rows 'Ours + SWA' (B/32), 'Ours w/ SWA' (B/16), 'Ours' (L/14)",
           ("coco",), ("ViT-B-32", "ViT-B-16", "ViT-L-14"), needs_pretrained=True),
    Recipe("pcmepp-table1-clip-zs", "OpenAI CLIP zero-shot on COCO retrieval (open_clip, no training)",
           "PCME++ (ICLR 2024) Table 1, rows 'CLIP ZS' per backbone", ("coco",), ("ViT-B-32", "ViT-B-16", "ViT-L-14"),
           needs_pretrained=True),
    Recipe("pcmepp-table1-train", "fine-tune ViT-B/32 on COCO with PCME++, InfoNCE and PCME, then evaluate",
           "PCME++ (ICLR 2024) Table 1 rows 'Ours', 'InfoNCE', 'PCME' (ViT-B/32); SE: Table C.9", ("coco",),
           ("pcmepp", "infonce", "pcme"), seeds=True),
    Recipe("pcmepp-table6", "pretrain ViT-S/16 PCME++ on RedCaps, then ImageNet zero-shot with every strategy",
           "PCME++ (ICLR 2024) Table 6, PCME++ rows", ("redcaps", "imagenet")),
    Recipe("prolip-zeroshot", "ProLIP published weights, ImageNet zero-shot and prompt re-weighting",
           "ProLIP (ICLR 2025) abstract: ViT-B/16 zero-shot and its few-shot prompt re-weighting", ("imagenet",),
           (PROLIP_PAPER_MODEL,), needs_pretrained=True),
    Recipe("pcme-coco", "PCME (CVPR 2021) COCO 1K / 5K with its published checkpoints",
           "PCME (CVPR 2021) Table 3", ("coco",),
           unsupported="PCME's published checkpoints (naver-ai/pcme: ResNet-152 image tower, GloVe word vectors, "
                       "its own module names) are not a format zsprob loads; train PCME with recipe "
                       "pcmepp-table1-train (variant pcme), PCME++'s re-implementation of it"),
)}

#: what each data folder under --data-root must hold, and where the manual says how to prepare it
DATA = {"coco": ("coco/dataset_coco.json", "COCO (Karpathy splits + images + annotations)"),
        "imagenet": ("imagenet/val", "ImageNet (val/ as synset folders; train/ for the held-out selection split)"),
        "redcaps": ("redcaps", "RedCaps (img2dataset .tar shards)")}
PREPARE = "README 'Real data and many GPUs' and docs/data.md"


def data_path(root: Path, kind: str) -> Path:
    return Path(root) / DATA[kind][0]
