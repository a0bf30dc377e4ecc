"""The PPOAPI-compatible HTTP gateway: unmodified Kea builds talk HTTP, the gateway speaks PPOZ."""
