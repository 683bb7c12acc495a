//! Conformance scenarios shared by the backends' test suites live in `tests/`; this library
//! holds helpers they share.
