// Anchor for the shared test precompiled header.
