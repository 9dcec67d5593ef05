"""The pod pool: discovery (static file, Kubernetes), metrics scraping, snapshots."""
