"""A small Sphinx extension: the bibliography lists each work under the label the text cites it by.

sphinxcontrib-bibtex's `author_year` referencing style prints a citation as "Agarwal et al., 2024"
(read from the entry's authors and year), but the bibliography's default pybtex style (`alpha`)
labels the same entry "[AVZ+24]", mangles accented names ("[ACGalle+24]") and cannot tell two
works of one author and year apart in the text. This extension registers, under one name
(`book_author_year`, selected by `bibtex_default_style` and `bibtex_reference_style` in
_config.yml and _config_zh.yml), the documented plugins of both libraries:

- a pybtex label style (`pybtex.style.labels`): the label of an entry is its author-year
  citation, made by sphinxcontrib-bibtex's own author_year template ("Wilson, 1927",
  "Efron and Tibshirani, 1993", "Agarwal et al., 2024"; LaTeX accents decoded: "Dósa, 2007"),
  with "a", "b", ... after the year where two entries would share a label
  ("Open Compute Project, 2023a" / "... 2023b");
- a pybtex sorting style (`pybtex.style.sorting`): by that label (accents and case folded), then
  year and title, so that the list reads in the order of its labels (organisations such as
  "Hugging Face" among the people, not after them);
- a pybtex formatting style (`pybtex.style.formatting`): `unsrt`'s entries with those labels
  and that order;
- a sphinxcontrib-bibtex referencing style (`sphinxcontrib.bibtex.style.referencing`):
  `author_year`, except that the year it prints is the label's year, suffix included, so that
  {cite:p}, {cite:t} and {cite:year} say "2023a" where the list does, and one {cite:p} of two
  works reads "[Open Compute Project, 2023a; Open Compute Project, 2023b]".
"""
from __future__ import annotations

import re
import unicodedata
from collections import Counter
from dataclasses import dataclass, field

import pybtex.plugin
from pybtex.richtext import Text
from pybtex.style.formatting.unsrt import Style as UnsrtStyle
from pybtex.style.labels import BaseLabelStyle
from pybtex.style.sorting import BaseSortingStyle
from pybtex.style.template import node
from sphinxcontrib.bibtex import plugin as bibtex_plugin
from sphinxcontrib.bibtex.style.referencing import BracketStyle
from sphinxcontrib.bibtex.style.referencing.author_year import AuthorYearReferenceStyle
from sphinxcontrib.bibtex.style.referencing.basic_author_year import (
    BasicAuthorYearParentheticalReferenceStyle,
    BasicAuthorYearTextualReferenceStyle,
)
from sphinxcontrib.bibtex.style.referencing.extra_year import ExtraYearReferenceStyle
from sphinxcontrib.bibtex.style.template import join, join2, post_text, pre_text, reference, year

NAME = "book_author_year"


# --- the text of a citation -----------------------------------------------------------------

def citation_text(entry, with_year: bool = True) -> str:
    """The entry as the author_year referencing style cites it, in plain text (no suffix).

    The template is sphinxcontrib-bibtex's own (its person style, separators and "et al."), so
    that the label cannot drift from the in-text citation.
    """
    style = _REFERENCE_STYLE
    authors = style.person.author_or_editor_or_title(full=False)
    template = join(sep=style.author_year_sep)[authors, year] if with_year else authors
    return template.format_data({"entry": entry, "style": style}).render_as("text")


def _fold(text: str) -> str:
    """For sorting: accents dropped, case folded ("Dósa" sorts as "dosa")."""
    decomposed = unicodedata.normalize("NFD", text)
    return "".join(c for c in decomposed if not unicodedata.combining(c)).casefold()


def _plain(latex: str) -> str:
    return Text.from_latex(latex).render_as("text")


# --- the pybtex plugins ---------------------------------------------------------------------

class LabelStyle(BaseLabelStyle):
    """Labels "Surname, Year", "Surname and Surname, Year", "Surname et al., Year", with a, b, ...
    after the year where the same label would otherwise repeat (in the order given)."""

    def format_labels(self, sorted_entries):
        labels = [citation_text(entry) for entry in sorted_entries]
        count, seen = Counter(labels), Counter()
        for label in labels:
            if count[label] == 1:
                yield label
            else:
                yield label + chr(ord("a") + seen[label])
                seen[label] += 1


class SortingStyle(BaseSortingStyle):
    """By the label's author part, then year, then title (accents and case folded)."""

    def sorting_key(self, entry):
        return (_fold(citation_text(entry, with_year=False)), entry.fields.get("year", ""),
                _fold(_plain(entry.fields.get("title", ""))))


class Style(UnsrtStyle):
    """unsrt's entries, labelled and sorted by author and year."""

    default_label_style = NAME
    default_sorting_style = NAME


# --- the sphinxcontrib-bibtex referencing style ---------------------------------------------

@node
def label_year(children, data):
    """The year as the entry's label prints it: "2023a" where the label is "..., 2023a"."""
    assert not children
    plain = year.format_data(data)
    label = data["formatted_entry"].label
    tail = label.rsplit(", ", 1)[-1]
    return Text(tail) if re.fullmatch(re.escape(str(plain)) + "[a-z]?", tail) else plain


@dataclass
class _Parenthetical(BasicAuthorYearParentheticalReferenceStyle):
    def inner(self, role_name):  # upstream's template with label_year for year
        return join2(sep1=self.pre_text_sep, sep2=self.post_text_sep)[
            pre_text,
            reference[join(sep=self.author_year_sep)[
                self.person.author_or_editor_or_title(full="s" in role_name), label_year]],
            post_text,
        ]


@dataclass
class _Textual(BasicAuthorYearTextualReferenceStyle):
    def inner(self, role_name):  # upstream's template with label_year for year
        return join(sep=self.text_reference_sep)[
            self.person.author_or_editor_or_title(full="s" in role_name),
            join[
                self.bracket.left,
                join2(sep1=self.pre_text_sep, sep2=self.post_text_sep)[
                    pre_text, reference[label_year], post_text],
                self.bracket.right,
            ],
        ]


@dataclass
class _Year(ExtraYearReferenceStyle):
    def inner(self, role_name):
        return reference[label_year]


@dataclass
class ReferenceStyle(AuthorYearReferenceStyle):
    """sphinxcontrib-bibtex's author_year, with the label's year ("2023a") in every role that
    prints a year: {cite:p}, {cite:t}, {cite:year} and their variants; the works of one
    parenthetical citation separated by "; " (a label has a comma of its own)."""

    bracket_parenthetical: BracketStyle = field(default_factory=lambda: BracketStyle(sep="; "))

    def __post_init__(self):
        super().__post_init__()
        ours = [
            _Parenthetical(bracket=self.bracket_parenthetical, person=self.person,
                           author_year_sep=self.author_year_sep,
                           pre_text_sep=self.pre_text_sep, post_text_sep=self.post_text_sep),
            _Textual(bracket=self.bracket_textual, person=self.person,
                     text_reference_sep=self.text_reference_sep,
                     pre_text_sep=self.pre_text_sep, post_text_sep=self.post_text_sep),
            _Year(bracket=self.bracket_year),
        ]
        self.styles.extend(ours)
        self.role_style.update((role, style) for style in ours for role in style.role_names())


_REFERENCE_STYLE = ReferenceStyle()


def register() -> None:
    """Register the four plugins under NAME (again: a no-op)."""
    pybtex.plugin.register_plugin("pybtex.style.labels", NAME, LabelStyle)
    pybtex.plugin.register_plugin("pybtex.style.sorting", NAME, SortingStyle)
    pybtex.plugin.register_plugin("pybtex.style.formatting", NAME, Style)
    bibtex_plugin.register_plugin("sphinxcontrib.bibtex.style.referencing", NAME, ReferenceStyle)


def setup(app):
    register()
    return {"version": "1.0", "parallel_read_safe": True, "parallel_write_safe": True}
