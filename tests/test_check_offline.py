"""tools/check_offline.py finds remote scripts and stylesheets in built pages (and local ones whose
file is missing), and only those."""
import check_offline


def test_remote_loads_are_found_and_local_ones_are_not(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "index.html").write_text(
        '<script src="_static/mathjax/tex-chtml.js"></script>'
        '<link rel="stylesheet" href="_static/theme.css">'
        '<a href="https://example.org">a link is not a load</a>')
    (tmp_path / "sub" / "page.html").write_text(
        '<script src="https://cdn.example.org/mathjax.js"></script>'
        '<link rel="stylesheet" href="//fonts.example.org/x.css">'
        '<script>inline()</script>')
    assert check_offline.remote_loads(tmp_path) == [
        ("sub/page.html", "https://cdn.example.org/mathjax.js"),
        ("sub/page.html", "//fonts.example.org/x.css")]
    assert check_offline.main([str(tmp_path)]) == 1
    (tmp_path / "sub" / "page.html").unlink()
    # index.html's local files do not exist yet
    assert check_offline.main([str(tmp_path)]) == 1
    (tmp_path / "_static" / "mathjax").mkdir(parents=True)
    (tmp_path / "_static" / "mathjax" / "tex-chtml.js").write_text("")
    (tmp_path / "_static" / "theme.css").write_text("")
    assert check_offline.main([str(tmp_path)]) == 0


def test_missing_local_loads_are_found_also_outside_the_folder(tmp_path):
    """The Chinese site (zh/) loads the English site's MathJax: an address that leaves the folder
    checked counts when its file exists; ?query and #fragment are not part of the file name."""
    zh = tmp_path / "zh"
    (zh / "chapters" / "x").mkdir(parents=True)
    (tmp_path / "_static" / "mathjax").mkdir(parents=True)
    (zh / "chapters" / "x" / "zh.html").write_text(
        '<script src="../../_static/../../_static/mathjax/tex-chtml.js"></script>'
        '<script src="../../_static/app.js?v=1a2b"></script>'
        '<script src="data:text/javascript,1"></script><script>inline()</script>')
    # a theme's template copied to _static is not a page
    (zh / "_static").mkdir()
    (zh / "_static" / "webpack-macros.html").write_text(
        '<script src="{{ pathto(\'_static/scripts/bootstrap.js\', 1) }}"></script>')
    assert check_offline.missing_loads(zh) == [
        ("chapters/x/zh.html", "../../_static/../../_static/mathjax/tex-chtml.js"),
        ("chapters/x/zh.html", "../../_static/app.js?v=1a2b")]
    (tmp_path / "_static" / "mathjax" / "tex-chtml.js").write_text("")
    (zh / "_static" / "app.js").write_text("")
    assert check_offline.missing_loads(zh) == [] and check_offline.main([str(zh)]) == 0
