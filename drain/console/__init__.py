"""``drain console``: the operator's page (extra ``jobdrain[console]``), served on its own port.

It reads through the operator's queries (drain.store.admin) and acts through the same ones as
``drain dead`` (retry, purge). Server-rendered (Starlette, Jinja2 with autoescaping, uvicorn),
no JavaScript: the overview refreshes with a meta refresh.

Layout: app.py (the routes, the security headers), access.py (who may act: the admin token or
an app's hook, sessions, CSRF), forms.py (a request's filter and action, read and checked),
figures.py (what a page shows, on the console's reused sessions), text.py (a row's text made
inert and bounded), serving.py (uvicorn on the port), templates/, static/.
"""
