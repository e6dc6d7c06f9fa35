"""tools/check_offline.py finds remote scripts and stylesheets in built pages, and only those."""
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
    assert check_offline.main([str(tmp_path)]) == 0
