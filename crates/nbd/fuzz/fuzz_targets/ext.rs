//! The ext2/3/4 superblock, descriptor and bitmap parser on arbitrary
//! images: the input is laid over a 256 KiB image from offset 1024 (the
//! superblock) with the ext magic forced, so the fuzzer explores the parser
//! rather than the magic check.
#![no_main]
use kemari_nbd::ext::used_blocks;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let mut img = vec![0u8; 256 * 1024];
    let n = data.len().min(img.len() - 1024);
    img[1024..1024 + n].copy_from_slice(&data[..n]);
    img[1024 + 56] = 0x53;
    img[1024 + 57] = 0xef;
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
