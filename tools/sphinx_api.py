"""Sphinx extension for the API pages (api_en.md, api_zh.md, through sphinx.ext.autodoc).

The package's docstrings are plain text written for `help(arl.rl_update)` in a terminal:
shapes such as `[B, T-1]`, `|log(pi_old / mu)|`, `TinyAgent(**config)`. reStructuredText
would read some of that as markup (a substitution, an unclosed emphasis) and either render
it wrongly or warn, so each docstring is shown as it is written, in a literal block. A
module's own docstring is dropped: it is generated ("Code saved from chapters/...") and
the page's heading above each module already says which chapter saves it.
"""


def literal_docstring(app, what, name, obj, options, lines):
    """autodoc-process-docstring: `lines` (the docstring, edited in place) becomes one
    literal block; a module's docstring becomes nothing."""
    if what == "module":
        lines[:] = []
        return
    while lines and not lines[-1].strip():
        lines.pop()
    if lines:
        lines[:] = ["::", ""] + [f"    {line}" if line.strip() else "" for line in lines] + [""]


def setup(app):
    app.connect("autodoc-process-docstring", literal_docstring)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
