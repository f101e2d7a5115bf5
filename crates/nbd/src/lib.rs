//! NBD target and proxy (issue 8).
