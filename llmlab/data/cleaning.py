"""Document cleaning: markup stripping, NFKC, whitespace. (Duplicates: prepare.Dedup, near_dup and minhash.)"""

from __future__ import annotations

import html
import re
import unicodedata

# Bump when the cleaning output changes, so old caches are not reused.
CLEANING_VERSION = 4  # 3: near-duplicates confirmed by exact Jaccard; 4: near-dup in stages (llmlab.data.near_dup)

_SCRIPT_STYLE = re.compile(r"<(script|style)\b[^>]*>.*?</\1\s*>", re.IGNORECASE | re.DOTALL)
_HTML_COMMENT = re.compile(r"<!--.*?-->", re.DOTALL)
_HTML_TAG = re.compile(r"</?[A-Za-z][A-Za-z0-9:-]*(?:\s[^<>]*)?/?>")
_WIKI_HEADING = re.compile(r"^[ \t]*(={1,6})[ \t]*(.*?)[ \t]*\1[ \t]*$", re.MULTILINE)
_WIKI_EMPHASIS = re.compile(r"'{2,}")
_WIKI_LINK = re.compile(r"\[\[(?:[^\[\]|]*\|)?([^\[\]]*)\]\]")
_WIKI_TEMPLATE = re.compile(r"\{\{[^{}]*\}\}")
# Image leftovers gensim's filter keeps: gallery lines "File:x.jpg|caption" and "caption|alt=description".
_WIKI_GALLERY_FILE = re.compile(r"^(?:File|Image):[^|\n]*\|", re.MULTILINE)
_WIKI_IMAGE_ALT = re.compile(r"\|alt=[^\n]*")
_SPACES = re.compile(r"[ \t\u00a0]+")
_SPACE_AROUND_NEWLINE = re.compile(r" *\n *")
_MANY_NEWLINES = re.compile(r"\n{3,}")
_WORD = re.compile(r"\w+")


# Each markup pass runs only when the text (as it is at that point) holds what the pass needs: plain prose, most of
# a web corpus, then costs the whitespace passes alone, with the same output (bench/data_scale.py).
_MARKUP_PASSES = (
    ("<", lambda t: _HTML_TAG.sub(" ", _HTML_COMMENT.sub(" ", _SCRIPT_STYLE.sub(" ", t)))),
    ("&", html.unescape),  # after tag removal, so an escaped "&lt;b&gt;" stays literal text
    ("{{", lambda t: _WIKI_TEMPLATE.sub(" ", t)),
    ("[[", lambda t: _WIKI_LINK.sub(r"\1", t)),
    (":", lambda t: _WIKI_GALLERY_FILE.sub("", t)),
    ("|alt=", lambda t: _WIKI_IMAGE_ALT.sub("", t)),
    ("=", lambda t: _WIKI_HEADING.sub(r"\2", t)),
    ("''", lambda t: _WIKI_EMPHASIS.sub("", t)),
)


def clean_text(text: str, start: bool = True, end: bool = True) -> str:
    """NFKC-normalised text without HTML tags/entities or wiki markup, whitespace tidied, stripped where the document
    starts and ends (`start`, `end`: a piece of a long document keeps the line break it was cut after)."""
    text = unicodedata.normalize("NFKC", text)  # full-width ＡＢＣ１２３ -> ABC123, ligatures split
    for needed, markup_pass in _MARKUP_PASSES:
        if needed in text:
            text = markup_pass(text)
    if "  " in text or "\t" in text or "\u00a0" in text:  # a lone space is already what _SPACES makes
        text = _SPACES.sub(" ", text)
    if " \n" in text or "\n " in text:
        text = _SPACE_AROUND_NEWLINE.sub("\n", text)
    if "\n\n\n" in text:
        text = _MANY_NEWLINES.sub("\n\n", text)
    if start and end:
        return text.strip()
    return text.lstrip() if start else text.rstrip() if end else text
