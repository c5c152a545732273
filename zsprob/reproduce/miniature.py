"""Real-format miniatures for ``zsprob reproduce --smoke``: a COCO folder (Karpathy dataset_coco.json, images,
caption and instance annotations), an ImageNet folder (a few synset folders of val/ and train/ images) and
RedCaps-like WebDataset shards (SynthWorld's pretraining shards: jpg, txt and json members as img2dataset
writes them). Small enough for CI; the readers are the ones real data goes through.
"""
from __future__ import annotations

import json
from pathlib import Path

COCO_IMAGES = 24   # 12 test, 6 val, 6 train
IMAGES_PER_SYNSET = 1  # in val/ and in train/, for each of the 1,000 classes (few-shot rows need every class)
SMOKE_TEMPLATES = ("a photo of a {}.", "a blurry photo of a {}.", "a drawing of a {}.")


def _image(path: Path, n: int) -> None:
    from PIL import Image, ImageDraw

    path.parent.mkdir(parents=True, exist_ok=True)
    img = Image.new("RGB", (40, 32), (37 * n % 256, 80 + 11 * n % 120, 200 - 7 * n % 150))
    ImageDraw.Draw(img).ellipse((4 + n % 9, 4, 30, 26 - n % 7), fill=(250, 240 - 9 * n % 200, 20))
    img.save(path, format="JPEG", quality=90)


def make_coco(root: Path) -> None:
    """COCO in its real layout: dataset_coco.json, train2014/ and val2014/ images, annotations/."""
    images, anns, inst = [], {"train2014": [], "val2014": []}, {"train2014": [], "val2014": []}
    for n in range(COCO_IMAGES):
        split = "test" if n < 12 else "val" if n < 18 else "train"
        folder = "train2014" if split == "train" else "val2014"
        cocoid = 100000 + n
        name = f"COCO_{folder}_{cocoid:012d}.jpg"
        _image(root / folder / name, n)
        sents = []
        for j in range(5):
            text = f"a photo of object {n % 7} number {j} in scene {n}"
            sid = 5 * n + j
            sents.append({"raw": text, "tokens": text.split(), "sentid": sid, "imgid": n})
            anns[folder].append({"image_id": cocoid, "id": 10 * sid + 1, "caption": text})
        images.append({"filepath": folder, "filename": name, "cocoid": cocoid, "split": split, "imgid": n,
                       "sentids": [s["sentid"] for s in sents], "sentences": sents})
        inst[folder].append({"image_id": cocoid, "category_id": 1 + n % 3, "id": n, "bbox": [0, 0, 1, 1]})
    (root / "annotations").mkdir(parents=True, exist_ok=True)
    cats = [{"id": i, "name": f"thing{i}", "supercategory": "x"} for i in (1, 2, 3)]
    for folder in ("train2014", "val2014"):
        imgs = [{"id": 100000 + n, "file_name": im["filename"]} for n, im in enumerate(images)
                if im["filepath"] == folder]
        (root / "annotations" / f"captions_{folder}.json").write_text(
            json.dumps({"images": imgs, "annotations": anns[folder]}))
        (root / "annotations" / f"instances_{folder}.json").write_text(
            json.dumps({"images": imgs, "annotations": inst[folder], "categories": cats}))
    (root / "dataset_coco.json").write_text(json.dumps({"images": images, "dataset": "coco"}))


def make_imagenet(root: Path) -> None:
    """ImageNet in its synset-folder layout: val/ and train/, one image of each ImageNet-1k class in each."""
    from zsprob.data.classification import imagenet_synsets

    for part, offset in (("val", 0), ("train", 5)):
        for c, wnid in enumerate(imagenet_synsets()):
            for i in range(IMAGES_PER_SYNSET):
                _image(root / part / wnid / f"{wnid}_{i}.JPEG", offset + 10 * c + i)


def make_redcaps(root: Path) -> None:
    """WebDataset shards as img2dataset writes them (SynthWorld's pretraining shards)."""
    from zsprob.data.synthetic import generate

    generate(root / "world", image_size=32, num_pretrain=64, num_classify_select=0, num_classify_eval=0,
             num_retrieval=0, num_retrieval_val=0, shard_size=32, progress=False)
    (root / "redcaps").mkdir(parents=True, exist_ok=True)
    for shard in sorted((root / "world" / "pretrain").glob("*.tar")):
        shard.replace(root / "redcaps" / shard.name)


def make_miniatures(root: Path, kinds) -> Path:
    """The miniatures of ``kinds`` under ``root`` (made once; ``root/.done-KIND`` marks each), the templates
    file and the untrained tiny checkpoint (``root/model``) of the smoke runs; returns ``root`` (their
    --data-root)."""
    makers = {"coco": lambda: make_coco(root / "coco"), "imagenet": lambda: make_imagenet(root / "imagenet"),
              "redcaps": lambda: make_redcaps(root)}
    root.mkdir(parents=True, exist_ok=True)
    for kind in kinds:
        done = root / f".done-{kind}"
        if not done.exists():
            makers[kind]()
            done.touch()
    (root / "templates.txt").write_text("\n".join(SMOKE_TEMPLATES) + "\n")
    if not (root / "model" / "zsprob.json").exists():  # the tiny model the smoke evaluations load
        from zsprob.models import create_model, save

        from zsprob.models.catalogue import SMOKE_MODEL

        save(create_model(SMOKE_MODEL, seed=0), root / "model")
    return root
