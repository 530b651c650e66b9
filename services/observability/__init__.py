"""What the dashboards and alerts may name: the Prometheus series the services export."""
