package main

import "syscall"

// childSysProcAttr makes the kernel kill a child when this process dies, however it dies.
func childSysProcAttr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
}
