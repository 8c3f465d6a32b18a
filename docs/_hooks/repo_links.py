"""mkdocs hook: links from docs/ to repository files outside docs/ (e.g. ``../benchmarks/results/x.md``).

The site holds only docs/, so such a link cannot be followed there. Each one is checked to point at a file or
folder that exists in the repository (a missing one fails the build, as a broken link inside docs/ does under
``--strict``) and is rendered as the repository path in code, e.g. ``benchmarks/results/x.md``. On a repository
browser the Markdown files keep their links.
"""

import os
import re

from mkdocs.exceptions import PluginError

_LINK = re.compile(r"(!?)\[([^\]]*)\]\(([^)\s]+)\)")


def on_page_markdown(markdown, page, config, files):
    docs_dir = os.path.realpath(config["docs_dir"])
    repo = os.path.dirname(docs_dir)
    here = os.path.dirname(os.path.realpath(page.file.abs_src_path))

    def replace(match):
        image, text, url = match.groups()
        if re.match(r"^[a-z][a-z0-9+.-]*:", url) or url.startswith(("#", "/")):
            return match.group(0)
        target = os.path.normpath(os.path.join(here, url.split("#")[0]))
        if target == docs_dir or target.startswith(docs_dir + os.sep):
            return match.group(0)  # inside docs/: mkdocs validates it
        rel = os.path.relpath(target, repo)
        if rel.startswith(os.pardir) or not os.path.exists(target):
            raise PluginError(f"{page.file.src_uri}: link to {url!r}: {rel} does not exist in the repository")
        shown = text.strip("`")
        if image or shown in (rel, os.path.basename(rel)):
            return f"`{rel}`"
        return f"{text} (`{rel}`)"

    return _LINK.sub(replace, markdown)
