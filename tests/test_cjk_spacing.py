"""tools/sphinx_zh.py, the typography of the Chinese site: no whitespace between two CJK
characters, on docutils trees (built by hand, or parsed from Markdown by MyST as the book is)."""
import pytest
from docutils import nodes
from docutils.core import publish_doctree

import sphinx_zh


def myst(text):
    """The docutils tree of a Markdown text, as MyST parses the book's pages."""
    from myst_parser.parsers.docutils_ import Parser
    return publish_doctree(text, parser=Parser(),
                           settings_overrides={"report_level": 5,
                                               "myst_enable_extensions": ["dollarmath"]})


def joined(text):
    tree = myst(text)
    sphinx_zh.join_cjk_gaps(tree)
    return tree


def texts(tree, kind):
    return [n.astext() for n in tree.findall(kind)]


def test_a_line_break_inside_a_paragraph_is_dropped():
    tree = joined("这是第一行，\n第二行在这里。")
    assert texts(tree, nodes.paragraph) == ["这是第一行，第二行在这里。"]


def test_the_indented_continuation_of_a_list_item_is_joined():
    tree = joined("- 列表项的第一行，\n  缩进的续行。\n- 第二项\n\n1. 编号项，\n   续行\n   再续一行。")
    assert texts(tree, nodes.paragraph) == ["列表项的第一行，缩进的续行。", "第二项",
                                            "编号项，续行再续一行。"]
    assert len(list(tree.findall(nodes.list_item))) == 3  # the lists stay lists


def test_a_bold_lead_in_and_the_text_after_it():
    # the space after "。" in one text node, and across a closing `strong` and the next text
    tree = joined("**要点**。 下一句。\n\n**要点** 下一句，**再看**\n这里。")
    assert texts(tree, nodes.paragraph) == ["要点。下一句。", "要点下一句，再看这里。"]
    assert texts(tree, nodes.strong) == ["要点", "要点", "再看"]  # the markup stays


def test_across_adjacent_inline_nodes_built_by_hand():
    para = nodes.paragraph("", "", nodes.Text("前文 "), nodes.strong("", " 加粗 "),
                           nodes.emphasis("", "\n强调"), nodes.Text("  后文"))
    assert sphinx_zh.join_cjk_gaps(nodes.section("", para)) == 3
    assert para.astext() == "前文加粗强调后文"
    assert [c.astext() for c in para.children] == ["前文", "加粗", "强调", "后文"]


@pytest.mark.parametrize("text", [
    "使用 Adam 优化器", "训练 300 步", "在 GPU 上", "模型 TinyAgent，共 2 层",
    "结果是 *pass@k* 指标", "English text stays as it is"])
def test_the_space_between_chinese_and_latin_words_or_digits_stays(text):
    tree = joined(text)
    assert texts(tree, nodes.paragraph) == [text.replace("*", "")]


def test_inline_code_and_math_keep_their_spaces_and_content():
    tree = joined("调用 `arl.evaluate` 得到 $\\hat p$ 的区间，`中 文` 不变，`代码`\n后面的中文。")
    para = next(tree.findall(nodes.paragraph))
    assert [n.astext() for n in para.findall(nodes.literal)] == ["arl.evaluate", "中 文", "代码"]
    assert [n.astext() for n in para.findall(nodes.math)] == ["\\hat p"]
    # (the line break after the code shows as the space that Chinese puts next to code)
    assert para.astext() == "调用 arl.evaluate 得到 \\hat p 的区间，中 文 不变，代码\n后面的中文。"


def test_code_blocks_are_untouched():
    source = "```python\nx = '中 文'\n# 中\n# 文\n```\n\n    缩进的\n    代码块"
    tree = joined(source)
    assert [t.strip() for t in texts(tree, nodes.literal_block)] == ["x = '中 文'\n# 中\n# 文",
                                                                     "缩进的\n代码块"]


def test_titles_and_full_width_punctuation():
    tree = joined("# 第一章 引言\n\n他说：「 好」 （ 见下）， 然后 “ 引号 ” 结束。")
    assert texts(tree, nodes.title) == ["第一章引言"]
    assert texts(tree, nodes.paragraph) == ["他说：「好」（见下），然后“引号”结束。"]


def test_other_whitespace_that_is_written_on_purpose_stays():
    # the ideographic space (U+3000) of the part captions, and a no-break space
    para = nodes.paragraph("", "", nodes.Text("第一部分\u3000基础 \u00a0与"))
    sphinx_zh.join_cjk_gaps(para)
    assert para.astext() == "第一部分\u3000基础 \u00a0与"


def test_raw_html_is_untouched():
    para = nodes.paragraph("", "", nodes.Text("前 "), nodes.raw("", "<b>中 文</b>", format="html"),
                           nodes.Text(" 后"))
    sphinx_zh.join_cjk_gaps(para)
    assert para.astext() == "前 <b>中 文</b> 后"


class Config:
    def __init__(self, language):
        self.language = language


@pytest.mark.parametrize("language, chinese", [("zh_CN", True), ("zh", True), ("en", False),
                                               (None, False)])
def test_only_the_chinese_site(language, chinese):
    assert sphinx_zh.is_zh(Config(language)) is chinese


def test_the_hidden_cell_prompt_gets_a_chinese_type_word():
    sub = sphinx_zh.PROMPT_TYPE.sub
    words = sphinx_zh.PROMPT_TYPES
    assert sub(lambda m: words[m.group()], "显示代码单元source") == "显示代码单元源代码"
    assert sub(lambda m: words[m.group()], "隐藏代码单元outputs") == "隐藏代码单元输出"
