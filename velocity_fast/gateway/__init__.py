"""The gateway app: routes, auth, request decoding, /stats, the admin port."""
