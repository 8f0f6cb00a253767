//! ferrovirt-controller (see docs/ARCHITECTURE.md).
