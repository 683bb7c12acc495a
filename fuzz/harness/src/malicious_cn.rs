pub fn run(_data: &[u8]) -> bool {
    true
}
