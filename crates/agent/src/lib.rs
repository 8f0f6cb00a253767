//! ferrovirt-agent (see docs/ARCHITECTURE.md).
