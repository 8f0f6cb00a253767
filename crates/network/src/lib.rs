//! ferrovirt-network (see docs/ARCHITECTURE.md).
