"""The glossary (glossary.yml) is complete and the Chinese chapters use its terms."""
from __future__ import annotations

import re

import pytest
import yaml

from book import ROOT, source, toc_files

GLOSSARY = yaml.safe_load((ROOT / "glossary.yml").read_text(encoding="utf8"))


def english_names(entry) -> list[str]:
    """``'jit (just-in-time compilation)'`` answers to both of its names."""
    names = [entry["en"].lower()]
    m = re.fullmatch(r"(.+?) \((.+)\)", names[0])
    return names + list(m.groups()) if m else names


TERMS = {name: entry["zh"] for entry in GLOSSARY for name in english_names(entry)}
# A Chinese term followed by its English name in full-width parentheses: 小批量（minibatch）
FIRST_USE = re.compile(r"([\u4e00-\u9fff]+)（([A-Za-z][A-Za-z \-]*)）")


def test_entries_are_complete_and_unique():
    for entry in GLOSSARY:
        assert set(entry) == {"en", "zh", "def_en", "def_zh"}, entry
        assert all(isinstance(v, str) and v.strip() for v in entry.values()), entry
    for key in ("en", "zh"):
        values = [e[key] for e in GLOSSARY]
        assert len(values) == len(set(values)), f"a {key} term appears twice"


@pytest.mark.parametrize("entry", toc_files("zh"))
def test_chinese_chapters_write_glossary_terms_the_glossary_way(entry):
    """Where a chapter introduces a glossary term with its English name, the Chinese
    before the parentheses must be the glossary's Chinese term."""
    text = source(entry).read_text(encoding="utf8").replace("*", "")   # *emphasis* aside
    wrong = [f"{zh}（{en}）: the glossary says {TERMS[en.lower()]}"
             for zh, en in FIRST_USE.findall(text)
             if en.lower() in TERMS and not zh.endswith(TERMS[en.lower()])]
    assert not wrong, "\n".join(wrong)


def test_the_check_catches_a_wrong_term():
    bad = "把一个小批次（minibatch）分到各个设备上"
    zh, en = FIRST_USE.findall(bad)[0]
    assert en in TERMS and not zh.endswith(TERMS[en])
