#[derive(arbitrary::Arbitrary, Debug)]
pub struct Input {}
pub fn run(_data: &[u8]) -> bool {
    true
}
