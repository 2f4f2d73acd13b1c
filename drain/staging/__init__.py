"""The app side: build job rows and insert them on the app's own connection, inside its transaction.

Nothing here imports the relay, the config loader, the CLI or the metrics: ``import drain`` in a web
app stays light.
"""
