#!/usr/bin/env python
"""Write prompts/ from open_clip's own zero-shot metadata, so the files stay identical to it.

    python scripts/make_prompts.py            # (re)write prompts/
    python scripts/make_prompts.py --check    # exit 1 if prompts/ differs from open_clip

Files: imagenet_templates.txt (the 80 CLIP templates, "{}" marks the class name),
imagenet_classnames.txt (the 1,000 CLIP class names in synset order), single_template.txt.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from open_clip.zero_shot_metadata import IMAGENET_CLASSNAMES, OPENAI_IMAGENET_TEMPLATES

OUT = Path(__file__).resolve().parents[1] / "prompts"


def contents() -> dict[str, str]:
    templates = [t("{}") for t in OPENAI_IMAGENET_TEMPLATES]
    for t in templates:
        assert "\n" not in t and t.count("{}") == 1, t
    assert all("\n" not in c for c in IMAGENET_CLASSNAMES)
    return {
        "imagenet_templates.txt": "\n".join(templates) + "\n",
        "imagenet_classnames.txt": "\n".join(IMAGENET_CLASSNAMES) + "\n",
        "single_template.txt": "a photo of a {}.\n",
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="only compare, do not write")
    args = ap.parse_args()
    bad = 0
    for name, text in contents().items():
        path = OUT / name
        if args.check:
            if not path.is_file() or path.read_text(encoding="utf-8") != text:
                print(f"differs: {path}")
                bad += 1
        else:
            OUT.mkdir(exist_ok=True)
            path.write_text(text, encoding="utf-8")
            print(f"wrote {path} ({text.count(chr(10))} lines)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
