"""The dashboard: ``GET /dashboard`` (index.html, one static page with inline JS, package data)
and ``GET /dashboard/data`` (its JSON, data.py), added to the app http_server.py builds."""
