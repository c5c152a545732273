"""prompts/ is generated from open_clip's metadata and must stay identical to it."""
from open_clip.zero_shot_metadata import IMAGENET_CLASSNAMES, OPENAI_IMAGENET_TEMPLATES

from zsprob.utils.paths import prompts_dir


def read_lines(name):
    return (prompts_dir() / name).read_text(encoding="utf-8").splitlines()


def test_templates_match_open_clip():
    lines = read_lines("imagenet_templates.txt")
    assert len(lines) == 80
    assert lines == [t("{}") for t in OPENAI_IMAGENET_TEMPLATES]


def test_classnames_match_open_clip():
    lines = read_lines("imagenet_classnames.txt")
    assert len(lines) == 1000 and lines == list(IMAGENET_CLASSNAMES)


def test_single_template():
    assert read_lines("single_template.txt") == ["a photo of a {}."]
