"""The orchestrator: topologies, routes, cohorts, and the client-facing Orchestrator service."""
