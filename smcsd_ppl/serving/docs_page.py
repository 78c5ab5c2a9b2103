"""``/docs``: Swagger UI over ``/openapi.json``, every file it loads served by the server itself.

A server here usually runs offline, where a page that loads Swagger UI from a CDN (FastAPI's
default) shows nothing. The ``swagger-ui-bundle`` package ships Swagger UI's files.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

DOCS_ASSETS = "/docs/assets"  # Swagger UI's files, served here: the page loads nothing from elsewhere
DOCS_PAGE = """<!doctype html>
<html>
<head>
<meta charset="utf-8">
<title>{title}</title>
<link rel="stylesheet" href="{assets}/swagger-ui.css">
<link rel="icon" href="{assets}/favicon-32x32.png">
</head>
<body>
<div id="swagger-ui"></div>
<script src="{assets}/swagger-ui-bundle.js"></script>
<script>
window.ui = SwaggerUIBundle({{
  url: "{openapi}", dom_id: "#swagger-ui", presets: [SwaggerUIBundle.presets.apis],
  layout: "BaseLayout", deepLinking: true
}});
</script>
</body>
</html>
"""


def add_docs_page(app: FastAPI) -> None:
    """``/docs``: Swagger UI over ``/openapi.json``, its scripts and styles served by this server.

    A server here usually runs offline, where a page that loads Swagger UI from a CDN shows nothing.
    """
    import swagger_ui_bundle

    app.mount(DOCS_ASSETS, StaticFiles(directory=swagger_ui_bundle.swagger_ui_path), name="docs-assets")

    page = DOCS_PAGE.format(title=f"{app.title} - API", assets=DOCS_ASSETS, openapi=app.openapi_url)

    @app.get("/docs", include_in_schema=False)
    async def docs():
        return HTMLResponse(page)
