"""GX Data Docs pages that render offline: no CDN, assets served from the reports folder.

GX's page templates load bootstrap, bootstrap-table, jQuery, popper, vega and
font-awesome from public CDNs and a logo from S3; the installed package ships
only its own styles, fonts and images (``great_expectations/render/view/static``),
not bootstrap or jQuery. So :func:`localize_page`:

- removes every ``<script src>`` and ``<link href>`` that points off the machine,
  and ``url(...)`` of remote images in inline styles,
- points the logo and favicon at the local copies of GX's images,
- adds ``isbflow-docs.css`` (shipped in this package): a small stylesheet for
  the bootstrap classes GX's markup uses (grid, tables, cards, badges), so the
  page reads well without bootstrap; collapsed sections stay open (no JS),
- unlinks GX's navigation to pages the report does not keep (the index, the
  suite page).

:func:`install_static` copies GX's static folder and the stylesheet to
``<reports>/_static`` once (again when the GX version changes). A localized
page holds no ``http(s)://`` resource reference; outbound ``<a href>`` links
stay (they load nothing).
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from isbflow.spec.paths import private_dir

STATIC_DIR = "_static"
STYLESHEET = "isbflow-docs.css"
_HERE = Path(__file__).parent / "static"

_REMOTE_SCRIPT = re.compile(r"<script\b[^>]*\bsrc\s*=\s*[\"'](?:https?:)?//[^\"']*[\"'][^>]*>\s*</script>", re.I)
_REMOTE_LINK = re.compile(r"<link\b[^>]*\bhref\s*=\s*[\"'](?:https?:)?//[^\"']*[\"'][^>]*/?>", re.I)
_REMOTE_IMG_SRC = re.compile(r"(<img\b[^>]*\bsrc\s*=\s*)[\"'](?:https?:)?//[^\"']*?([A-Za-z0-9_-]+\.(?:png|svg|gif|ico))[^\"']*[\"']", re.I)
_REMOTE_URL = re.compile(r"url\(\s*[\"']?(?:https?:)?//[^)]*\)", re.I)
_LOCAL_STATIC = re.compile(r"((?:src|href)\s*=\s*[\"'])(?:\.\./)+static/", re.I)
_GX_NAV = re.compile(r"(<a\b[^>]*\b)href\s*=\s*[\"'](?:\.\./)+(?:index\.html|expectations/[^\"']*)[\"']", re.I)
#: any remaining reference that would make the browser fetch from off the machine
REMOTE_RESOURCE = re.compile(r"(?:<script\b[^>]*\bsrc|<link\b[^>]*\bhref|<img\b[^>]*\bsrc|url\()\s*=?\s*[\"']?(?:https?:)?//",
                             re.I)


def localize_page(html: str, static_url: str) -> str:
    """GX's page with remote assets removed and local ones under ``static_url`` (e.g. ``../../_static``)."""
    static_url = static_url.rstrip("/")
    out = _REMOTE_SCRIPT.sub("", html)
    out = _REMOTE_LINK.sub("", out)
    out = _REMOTE_IMG_SRC.sub(lambda m: f'{m.group(1)}"{static_url}/images/{_local_image(m.group(2))}"', out)
    out = _REMOTE_URL.sub("none", out)
    out = _LOCAL_STATIC.sub(lambda m: f"{m.group(1)}{static_url}/", out)
    out = _GX_NAV.sub(lambda m: m.group(1).rstrip(), out)
    link = f'<link rel="stylesheet" href="{static_url}/{STYLESHEET}">'
    out = re.sub(r"</head>", link + "\n</head>", out, count=1, flags=re.I) if "</head>" in out.lower() \
        else link + out
    return out


def _local_image(name: str) -> str:
    """A remote GX image by its file name, mapped to a copy GX ships."""
    return name if (_gx_static() / "images" / name).exists() else "logo-long.png"


def _gx_static() -> Path:
    # lazy: great_expectations takes seconds to import; only a quality run and its Data Docs need it
    import great_expectations.render.view as view

    return Path(view.__file__).parent / "static"


def install_static(reports_root: Path) -> Path:
    """Copy GX's static assets and the isbflow stylesheet to ``<reports>/_static``; return it."""
    # lazy: great_expectations takes seconds to import; only a quality run and its Data Docs need it
    import great_expectations as gx

    target = reports_root / STATIC_DIR
    stamp = target / ".gx-version"
    if stamp.exists() and stamp.read_text() == gx.__version__ and (target / STYLESHEET).exists():
        return target
    private_dir(target)  # under the data dir: owner only, like it
    for sub in ("images", "styles", "fonts"):
        src = _gx_static() / sub
        if src.is_dir():
            shutil.copytree(src, target / sub, dirs_exist_ok=True)
    shutil.copyfile(_HERE / STYLESHEET, target / STYLESHEET)
    stamp.write_text(gx.__version__)
    return target
