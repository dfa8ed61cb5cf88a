/* preadv (page cache) vs O_DIRECT reads of shard-sized records into one aligned buffer:
   wall and CPU seconds per GB. usage: read_modes FILE CHUNK_BYTES */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/resource.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>
static double now(void){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
static double cpu(void){struct rusage r;getrusage(RUSAGE_SELF,&r);return r.ru_utime.tv_sec+r.ru_utime.tv_usec*1e-6+r.ru_stime.tv_sec+r.ru_stime.tv_usec*1e-6;}
static void run(const char*name,const char*path,int flags,size_t chunk,char*buf,off_t size){
  int fd=open(path,O_RDONLY|flags); if(fd<0){perror(name);return;}
  double w0=now(),c0=cpu(); off_t total=0;
  for(off_t off=0;off+ (off_t)chunk<=size;off+=chunk){struct iovec v={buf+(off%(64<<20)),chunk};
    ssize_t n=preadv(fd,&v,1,off); if(n<=0){perror("preadv");break;} total+=n;}
  double w=now()-w0,c=cpu()-c0; close(fd);
  printf("%-22s %.2f GB/s  %.3f CPU-s per GB\n",name,total/w/1e9,c/(total/1e9));
}
int main(int argc,char**argv){
  size_t chunk=atol(argv[2]); char*buf; posix_memalign((void**)&buf,4096,(64<<20)+chunk);
  int fd=open(argv[1],O_RDONLY); off_t size=lseek(fd,0,SEEK_END); close(fd);
  run("preadv (warm cache)",argv[1],0,chunk,buf,size);
  run("preadv (warm, again)",argv[1],0,chunk,buf,size);
  run("O_DIRECT",argv[1],O_DIRECT,chunk,buf,size);
  run("O_DIRECT (again)",argv[1],O_DIRECT,chunk,buf,size);
  return 0;}
