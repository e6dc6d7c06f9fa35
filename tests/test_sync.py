"""tools/sync.py: code cells en -> zh, Chinese markdown kept, and the checks."""
import pytest

import sync
from helpers import Project, code, md, read_nb, write_nb

EN = [
    md("title", "# 1. Introduction\n\nIn this chapter you will train a tiny agent."),
    code("setup", "x = 1\nprint(x)", text="1\n", count=1),
    md("prose", "We saw that the value is one, as [the docs](https://example.org) say."),
    md("formula", "$$\\mathcal{L} = -\\sum_t \\log p(a_t)$$"),
    code("more", "print(x + 1)", text="2\n", count=2),
]
ZH = [
    md("title", "# 1. 引言\n\n本章将训练一个小型智能体。"),
    code("setup", "x = 1\nprint(x)", text="1\n", count=1),
    md("prose", "我们看到这个值是一，正如[文档](https://example.org)所说。"),
    md("formula", "$$\\mathcal{L} = -\\sum_t \\log p(a_t)$$"),  # math only: may stay identical
    code("more", "print(x + 1)", text="2\n", count=2),
]


@pytest.fixture
def book(tmp_path):
    project = Project(tmp_path)
    project.folder = project.chapter("01_introduction", EN, ZH)
    return project


def check(book, capsys):
    """Run `sync --check`; return (exit code, stderr)."""
    capsys.readouterr()
    code_ = sync.main(book.root, check=True)
    return code_, capsys.readouterr().err


def edit(path, cell_id, **fields):
    """Change fields of one cell of a notebook on disk."""
    nb = read_nb(path)
    for cell in nb.cells:
        if cell.id == cell_id:
            cell.update(fields)
    write_nb(path, nb.cells)


def test_in_step_pair_passes(book, capsys):
    assert check(book, capsys) == (0, "")


def test_check_catches_changed_code(book, capsys):
    edit(book.folder / "zh.ipynb", "setup", source="x = 2\nprint(x)")
    rc, err = check(book, capsys)
    assert rc == 1 and "chapters/01_introduction/zh.ipynb: cell setup: source" in err


def test_check_catches_changed_output(book, capsys):
    nb = read_nb(book.folder / "en.ipynb")
    nb.cells[4].outputs[0].text = "3\n"
    write_nb(book.folder / "en.ipynb", nb.cells)
    rc, err = check(book, capsys)
    assert rc == 1 and "cell more: outputs" in err
    edit(book.folder / "en.ipynb", "more", execution_count=7)
    assert "cell more: outputs, execution_count" in check(book, capsys)[1]


def test_check_catches_untranslated_markdown(book, capsys):
    edit(book.folder / "zh.ipynb", "prose", source=EN[2].source)
    rc, err = check(book, capsys)
    assert rc == 1 and "cell prose: untranslated" in err
    assert "formula" not in err


def test_check_catches_missing_cells_and_order(book, capsys):
    write_nb(book.folder / "zh.ipynb", [ZH[0], ZH[1], ZH[3]])
    rc, err = check(book, capsys)
    assert rc == 1
    assert "cell prose: missing Chinese markdown cell" in err
    assert "cell more: missing code cell" in err
    write_nb(book.folder / "zh.ipynb", [ZH[0], ZH[2], ZH[1], ZH[3], ZH[4]])
    assert "not in the order of en.ipynb" in check(book, capsys)[1]


def test_check_catches_stale_and_missing_notebook(book, capsys):
    write_nb(book.folder / "zh.ipynb", ZH + [md("old", "旧的段落。")])
    assert "cell old: stale" in check(book, capsys)[1]
    (book.folder / "zh.ipynb").unlink()
    rc, err = check(book, capsys)
    assert rc == 1 and "zh.ipynb: missing" in err


def test_write_copies_code_and_outputs_and_keeps_chinese(book, capsys):
    nb = read_nb(book.folder / "en.ipynb")
    nb.cells[1].source = "x = 5\nprint(x)"
    nb.cells[1].outputs[0].text = "5\n"
    nb.cells.insert(4, code("new", "y = x", count=3))
    write_nb(book.folder / "en.ipynb", nb.cells)
    # zh in a different order, with a code cell that en no longer has
    write_nb(book.folder / "zh.ipynb", [ZH[2], ZH[0], ZH[1], code("gone", "z = 0"), ZH[3], ZH[4]])
    assert sync.main(book.root) == 0
    zh = read_nb(book.folder / "zh.ipynb")
    assert [c.id for c in zh.cells] == ["title", "setup", "prose", "formula", "new", "more"]
    assert zh.cells[1].source == "x = 5\nprint(x)" and zh.cells[1].outputs[0].text == "5\n"
    assert zh.cells[0].source == ZH[0].source and zh.cells[2].source == ZH[2].source
    assert check(book, capsys) == (0, "")
    before = (book.folder / "zh.ipynb").read_text()
    assert sync.main(book.root) == 0 and (book.folder / "zh.ipynb").read_text() == before


def test_write_refuses_english_prose_and_stale_chinese(book, capsys):
    nb = read_nb(book.folder / "en.ipynb")
    nb.cells.append(md("summary", "In summary, agents learn from rewards."))
    write_nb(book.folder / "en.ipynb", nb.cells)
    before = (book.folder / "zh.ipynb").read_text()
    capsys.readouterr()
    assert sync.main(book.root) == 2
    assert "summary" in capsys.readouterr().err
    assert (book.folder / "zh.ipynb").read_text() == before  # nothing written
    # --add-missing adds a stub, which the check rejects until it is translated.
    assert sync.main(book.root, add_missing=True) == 0
    rc, err = check(book, capsys)
    assert rc == 1 and "cell summary: still marked" in err
    write_nb(book.folder / "zh.ipynb", ZH + [md("old", "旧的段落。")])
    assert sync.main(book.root) == 2


def test_missing_zh_is_an_error_unless_asked(book, capsys):
    (book.folder / "zh.ipynb").unlink()
    assert sync.main(book.root) == 2
    assert not (book.folder / "zh.ipynb").exists()
    assert sync.main(book.root, chapters=[str(book.folder)], add_missing=True) == 0
    zh = read_nb(book.folder / "zh.ipynb")
    assert [c.id for c in zh.cells] == [c.id for c in EN]
    assert zh.cells[0].source.startswith(sync.TODO)


@pytest.mark.parametrize("text, expected", [
    ("We saw that the loss goes down.", True),
    ("我们看到损失在下降 (loss goes down)。", False),
    ("$$\\frac{a}{b}$$", False),
    ("## Exercises", False),
    ("![learning curve](fig.png)", False),
    ("```python\nprint('hello world again')\n```", False),
    ("See `pack_sequences` and https://example.org/some/long/path", False),
])
def test_untranslated_heuristic(text, expected):
    assert sync.untranslated(text) is expected


@pytest.mark.parametrize("broken, breaks, joined", [
    # an unindented break; code and math are left alone
    ("我们看到这个值是一，\n正如文档所说。\n\n```python\n中\n文\n```\n$$\n中\n文\n$$", 1,
     "我们看到这个值是一，正如文档所说。\n\n```python\n中\n文\n```\n$$\n中\n文\n$$"),
    # a list item's continuation line is indented: the newline and the indentation show as a
    # space between the two Chinese characters, as an unindented break does
    ("- 第一项的第一行，\n  缩进的续行。\n- 第二项，\n\t制表符缩进。\n\n1. 编号项，\n   续行。", 3,
     "- 第一项的第一行，缩进的续行。\n- 第二项，制表符缩进。\n\n1. 编号项，续行。"),
])
def test_check_catches_line_breaks_inside_chinese_text_and_join_fixes_them(book, capsys, broken,
                                                                           breaks, joined):
    edit(book.folder / "zh.ipynb", "prose", source=broken)
    rc, err = check(book, capsys)
    assert rc == 1 and (f"chapters/01_introduction/zh.ipynb: cell prose: {breaks} line "
                        "break(s) between Chinese characters") in err
    assert sync.main(book.root, join_cjk=True) == 0
    cell = next(c for c in read_nb(book.folder / "zh.ipynb").cells if c.id == "prose")
    assert cell.source == joined
    assert check(book, capsys) == (0, "")


@pytest.mark.parametrize("text, breaks", [
    ("中文\n中文", 1), ("中文\n\n中文", 0), ("中文\nEnglish", 0), ("English\n中文", 0),
    ("句子。\n下一句", 1), ("`代码`\n中文", 0), ("```\n中\n文\n```", 0), ("$$\n中\n文\n$$", 0),
])
def test_cjk_breaks_counts_only_prose_newlines_between_cjk(text, breaks):
    assert sync.cjk_breaks(text) == breaks
    assert sync.cjk_breaks(sync.join_cjk_breaks(text)) == 0




@pytest.mark.parametrize("text, breaks", [
    ("中文\n  中文", 1), ("- 项目，\n  续行", 1), ("1. 项目，\n   续行", 1), ("中文\n\n  中文", 0),
    ("- 项目\n  - 子项", 0), ("中文\n  `代码`", 0), ("中文 \n  English", 0),
    # a heading (or table row) ends at its newline: no space shows there
    ("## 小结\n正文", 0), ("## 小结\n  正文", 0), ("| 表 | 格\n文字", 0),
])
def test_cjk_breaks_counts_indented_continuations_too(text, breaks):
    assert sync.cjk_breaks(text) == breaks
    assert sync.cjk_breaks(sync.join_cjk_breaks(text)) == 0
    if breaks:
        assert "\n" not in sync.join_cjk_breaks(text)


def _caption(path, cell_id, caption, name="fig-01-more"):
    """Give one code cell of a notebook on disk a MyST-NB figure caption."""
    nb = read_nb(path)
    for cell in nb.cells:
        if cell.id == cell_id:
            cell.metadata["mystnb"] = {"figure": {"caption": caption, "name": name}}
    write_nb(path, nb.cells)


def test_figure_captions_are_translated_and_kept(book, capsys):
    en, zh = book.folder / "en.ipynb", book.folder / "zh.ipynb"
    _caption(en, "more", "The value rises by one.")
    sync.main(book.root)                 # a new caption: zh gets the English one ...
    rc, err = check(book, capsys)
    assert rc == 1 and "cell more: figure caption not in Chinese" in err
    _caption(zh, "more", "数值加一。")     # ... until it is translated
    assert check(book, capsys) == (0, "")
    sync.main(book.root)                 # a sync keeps the Chinese caption
    assert read_nb(zh).cells[4].metadata["mystnb"]["figure"]["caption"] == "数值加一。"
    assert check(book, capsys) == (0, "")
    _caption(zh, "more", "数值加一。", name="fig-01-other")  # the rest is copied, checked
    rc, err = check(book, capsys)
    assert rc == 1 and "cell more: metadata differ" in err
