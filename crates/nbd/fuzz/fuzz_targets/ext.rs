//! The ext2/3/4 superblock, descriptor and bitmap parser on arbitrary images.
#![no_main]
use kemari_nbd::ext::used_blocks;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let mut img = data.to_vec();
    img.resize(img.len().max(4096) , 0);
    let size = img.len() as u64;
    let mut rd = |o: u64, b: &mut [u8]| {
        let o = o as usize;
        match img.get(o..o + b.len()) {
            Some(s) => {
                b.copy_from_slice(s);
                Ok(())
            }
            None => Err(std::io::Error::other("out of range")),
        }
    };
    let _ = used_blocks(&mut rd, size, 4096);
});
